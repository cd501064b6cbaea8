"""Initial parameter values as a pure function of (seed, element index), so any slice can be filled on its own.

torch's CPU generator is a sequence: a rank holding a shard of a parameter cannot draw "its" numbers without
drawing everything before them. These fills instead hash each element's flat index in the full parameter together
with the seed (a splitmix64 finaliser, on int64 tensors with wrapping arithmetic) into a uniform number, and map it
through the inverse CDF of the target distribution. A rank then materialises exactly its own shard (`fill_box`),
with the values one process would give the whole tensor, in bounded temporary memory (CHUNK elements at a time):
torchtitan/distributed/utils.py's param_init uses that for sharded (DTensor) parameters.

The seed is the generator's current seed (`torch.initial_seed()`), which torchtitan/components/model_parts.py's
seeded_param_init sets per parameter name before each fill. Model code stays plain torch: it only names the
distribution (`TruncNormal(std)`, `Normal(std)`, `Constant(value)`).
"""

from __future__ import annotations

import math

import torch

CHUNK = 1 << 20  # elements per generation step: the temporaries stay near CHUNK x 40 bytes (int64 and float64)
# On an accelerator the values are generated where the parameter lives, in larger steps (a step is a few kernel
# launches; 16M elements keep ~640 MB of temporaries): an 8B model's init then runs at memory bandwidth instead
# of through the host's float64 erfinv and a copy per chunk. The values are a function of (seed, element) on
# every device (integer hashing is exact; erfinv in float64 then rounded to the parameter's dtype).
ACCELERATOR_CHUNK = 1 << 24


def chunk_elements(device: torch.device) -> int:
    return CHUNK if device.type == "cpu" else ACCELERATOR_CHUNK

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; the products wrap the same way)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed integers)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def uniform_at(seed: int, index: torch.Tensor) -> torch.Tensor:
    """float64 in (0, 1), a function of (seed, index) only; `index` int64 (any shape, on any device)."""
    key = int(_mix(torch.tensor([(seed * _GOLDEN) % (1 << 63)], dtype=torch.int64))[0])
    bits = _shr(_mix(index * _GOLDEN + key), 11)  # the top 53 bits
    return (bits.double() + 0.5) * 2.0**-53


def _flat_index(global_shape: tuple[int, ...], offset: tuple[int, ...], rows: range,
                local_shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """Flat indices in the whole tensor of the box rows x local_shape[1:] starting at `offset`."""
    strides = [math.prod(global_shape[d + 1:]) for d in range(len(global_shape))]
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, size in enumerate(local_shape):
        span = range(rows.start, rows.stop) if d == 0 else range(size)
        coords = torch.arange(offset[d] + span.start, offset[d] + span.stop, dtype=torch.int64,
                              device=device) * strides[d]
        index = index.unsqueeze(-1) + coords
    return index


class Fill:
    """A distribution of initial values. `fill(t)` fills a whole tensor; `fill_box` fills a shard of one."""

    def values(self, u: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if hasattr(tensor, "placements"):  # a DTensor: only its placements say which box this rank holds
            raise TypeError("a sharded (DTensor) parameter is filled through torchtitan.distributed.utils.param_init "
                            "(pass it as init_weights' param_init), which fills this rank's box of the tensor")
        self.fill_box(tensor, tuple(tensor.shape), (0,) * tensor.dim())
        return tensor

    def fill_box(self, local: torch.Tensor, global_shape: tuple[int, ...], offset: tuple[int, ...]) -> None:
        """Fill `local` with the values of the box of the whole [global_shape] tensor that starts at `offset`."""
        seed = torch.initial_seed()
        device = local.device if local.device.type != "meta" else None
        if local.dim() == 0:
            local.copy_(self.values(uniform_at(seed, torch.zeros((), dtype=torch.int64, device=device))))
            return
        row = max(1, math.prod(local.shape[1:]))
        step = max(1, chunk_elements(local.device) // row)
        for start in range(0, local.shape[0], step):
            rows = range(start, min(start + step, local.shape[0]))
            index = _flat_index(tuple(global_shape), tuple(offset), rows, tuple(local.shape), device)
            local[rows.start:rows.stop].copy_(self.values(uniform_at(seed, index)))


class TruncNormal(Fill):
    """Normal(0, std) cut at a and b (default +-3 std: no single weight starts as an outlier)."""

    def __init__(self, std: float, a: float | None = None, b: float | None = None) -> None:
        self.std, self.a, self.b = std, -3 * std if a is None else a, 3 * std if b is None else b

    def values(self, u: torch.Tensor) -> torch.Tensor:
        lo, hi = (0.5 * (1 + math.erf(x / self.std / math.sqrt(2))) for x in (self.a, self.b))
        p = lo + u * (hi - lo)
        return (torch.erfinv(2 * p - 1) * (math.sqrt(2) * self.std)).clamp_(self.a, self.b)


class Normal(Fill):
    def __init__(self, std: float) -> None:
        self.std = std

    def values(self, u: torch.Tensor) -> torch.Tensor:
        return torch.erfinv(2 * u - 1) * (math.sqrt(2) * self.std)


class Constant(Fill):
    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(self.value)

    def fill_box(self, local: torch.Tensor, global_shape: tuple[int, ...], offset: tuple[int, ...]) -> None:
        local.fill_(self.value)
