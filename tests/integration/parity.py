"""What every rank of a pool (tests/integration/pool.py) runs for one layout, and how runs are compared.

`run_layout` parses the layout's command line with the trainer's own config code, builds the Trainer exactly as
`run_train.sh` would (mesh, model, parallelisms, data, optimizer, checkpoint), trains, and returns per step the
metrics the trainer logged (loss, gradient norm before clipping, validation loss) and a checksum of every
parameter after the step. `compare` checks a run against the 1-process reference at the tolerances of
docs/testing.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.components.model_parts import named_parameters

# Tolerances, relative, derived in docs/testing.md from the measured noise floor of mathematically equal runs.
TOLERANCE = {"loss": 3e-6, "val_loss": 2e-6, "grad_norm": 1e-6, "param": 1e-6, "moe_aux_loss": 2e-6, "moe_z_loss": 2e-6}


@dataclass(frozen=True)
class Layout:
    name: str
    """test id"""
    nproc: int
    """ranks of the pool that runs it"""
    overrides: tuple[str, ...]
    """config overrides on top of the common ones"""
    reference: str = "single_process"
    """the 1-process layout whose results this one must match"""


def run_layout(argv: list[str], dump_folder: str, faults: tuple = (), expect: str = "success") -> dict | None:
    """Train one layout on this rank; rank 0 returns {"metrics": [...], "params": [...]}, the others None.

    expect="setup_error": building the Trainer must fail with a one-line ValueError (as `run()` reports it);
    expect="training_error": training must stop with a TrainingError. Every rank then returns {"error": message}
    (and rank 0 the metrics logged until then) instead of raising, so the pool stays usable.
    """
    from torchtitan.components.step_guard import TrainingError
    from torchtitan.config.manager import load_config
    from torchtitan.distributed.utils import env_world
    from torchtitan.train import Trainer

    rank, _, world = env_world()
    cfg, resolved = load_config([*argv, "--job.dump_folder", dump_folder], world)
    parallel_dims = resolved.parallel_dims
    params: list[dict[str, list[float]]] = []
    # The layout's process groups stay alive after it: DTensor caches sharding decisions per (equal) mesh, so a
    # later layout with an equal mesh reuses the groups an earlier one created (same ranks, same meaning), and
    # destroying them would leave those cache entries pointing at dead groups.
    try:
        trainer = Trainer(cfg, resolved, torch.device("cpu"))
    except ValueError as e:
        if expect == "setup_error":
            return {"error": str(e)}
        raise
    assert expect != "setup_error", "the layout was expected to fail during setup, but the Trainer was built"
    for fault in faults:
        FAULTS[fault[0]](trainer, *fault[1:])
    result: dict[str, Any] = {}
    try:
        trainer.train(after_step=lambda step: params.append(param_checksums(trainer.model_parts, parallel_dims)))
    except TrainingError as e:
        if expect != "training_error":
            raise
        result["error"] = str(e)
    assert expect != "training_error" or "error" in result, "training was expected to stop with an error"
    trainer.close()
    if rank != 0:
        return result or None
    metrics_file = Path(dump_folder) / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line] \
        if metrics_file.exists() else []
    return {**result, "metrics": metrics, "params": params}


def param_checksums(model_parts: list[torch.nn.Module], parallel_dims) -> dict[str, list[float]]:
    """name -> [sum, sum of |x|, sum of x^2] of every parameter over the whole job, in float64.

    Each rank adds the elements it holds uniquely (a shard counts once; a replica only on the rank whose
    coordinate is 0 on every replicated mesh dimension), and one all-gather merges the partial sums by name,
    so stages or expert groups that hold different parameters merge too.
    """
    mine: dict[str, list[float]] = {}
    for name, p in named_parameters(model_parts):
        if isinstance(p, DTensor):
            coordinate = p.device_mesh.get_coordinate()
            owner = all(c == 0 for c, pl in zip(coordinate, p.placements, strict=True) if isinstance(pl, Replicate))
            local = p.to_local()
        else:  # a plain replica (one process, DDP): counted once, on the first rank of every other dimension
            owner = all(parallel_dims.world_mesh[d].get_local_rank() == 0 for d in ("dp_replicate", "dp_shard", "cp",
                                                                                    "tp"))
            local = p
        if owner:
            x = local.detach().to(torch.float64)
            mine[name] = [x.sum().item(), x.abs().sum().item(), x.square().sum().item()]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: dict[str, list[float]] = {}
    for part in gathered:
        for name, sums in part.items():
            merged[name] = [a + b for a, b in zip(merged.get(name, [0.0, 0.0, 0.0]), sums, strict=True)]
    return merged


def compare(run: dict, reference: dict, tolerance: dict[str, float] = TOLERANCE) -> list[str]:
    """Every discrepancy beyond tolerance, worst first per kind; empty when the run matches the reference."""
    problems: list[tuple[float, str]] = []
    ref_metrics, got_metrics = reference["metrics"], run["metrics"]
    if [m["step"] for m in got_metrics] != [m["step"] for m in ref_metrics]:
        return [f"logged steps {[m['step'] for m in got_metrics]} != reference {[m['step'] for m in ref_metrics]}"]
    for got, ref in zip(got_metrics, ref_metrics, strict=True):
        for key in ("loss", "grad_norm", "val_loss", "moe_aux_loss", "moe_z_loss"):
            if key in ref or key in got:
                if key not in got or key not in ref:
                    problems.append((math.inf, f"step {ref['step']}: {key} logged by only one of the runs"))
                    continue
                rel = abs(got[key] - ref[key]) / max(abs(ref[key]), 1e-12)
                if not rel <= tolerance[key]:
                    problems.append((rel, f"step {ref['step']}: {key} {got[key]!r} vs {ref[key]!r} (rel {rel:.2e})"))
    if len(run["params"]) != len(reference["params"]):
        problems.append((math.inf, f"{len(run['params'])} parameter checksums vs {len(reference['params'])}"))
    for step, (got, ref) in enumerate(zip(run["params"], reference["params"], strict=False), start=1):
        if set(got) != set(ref):
            problems.append((math.inf, f"step {step}: parameter names differ: {sorted(set(got) ^ set(ref))[:4]}"))
            continue
        for name in ref:
            (s, a, q), (rs, ra, rq) = got[name], ref[name]
            # the plain sum can cancel to ~0: measure its error against the sum of magnitudes instead
            rel = max(abs(s - rs) / max(ra, 1e-30), abs(a - ra) / max(ra, 1e-30), abs(q - rq) / max(rq, 1e-30))
            if not rel <= tolerance["param"]:
                problems.append((rel, f"step {step}: parameter {name} checksum off by {rel:.2e} relative"))
    problems.sort(key=lambda p: -p[0])
    return [text for _, text in problems]


def max_relative_differences(run: dict, reference: dict) -> dict[str, float]:
    """The largest relative difference of each kind: the noise floor when both runs are mathematically equal."""
    worst = dict.fromkeys(TOLERANCE, 0.0)
    for got, ref in zip(run["metrics"], reference["metrics"], strict=True):
        for key in ("loss", "grad_norm", "val_loss", "moe_aux_loss", "moe_z_loss"):
            if key in ref:
                worst[key] = max(worst[key], abs(got[key] - ref[key]) / abs(ref[key]))
    for got, ref in zip(run["params"], reference["params"], strict=True):
        for name in ref:
            (s, a, q), (rs, ra, rq) = got[name], ref[name]
            worst["param"] = max(worst["param"], abs(s - rs) / ra, abs(a - ra) / ra, abs(q - rq) / rq)
    return worst


# ---- faults and mutations the tests inject into a built Trainer (never into production code) -------------------

def _nan_gradient(trainer, module_fqn: str, step: int, rank: int) -> None:
    """From `module_fqn`'s output back, the backward pass of step `step` on `rank` carries NaN."""
    from torchtitan.distributed.utils import env_world

    class _NanBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return torch.full_like(grad, float("nan"))

    def hook(module, inputs, output):
        if env_world()[0] == rank and trainer.train_state.step == step - 1 and module.training:
            return _NanBackward.apply(output)
        return output

    for part in trainer.model_parts:
        try:
            part.get_submodule(module_fqn).register_forward_hook(hook)
        except AttributeError:
            continue  # another pipeline stage holds it


def _average_gradients(trainer) -> None:
    """The bug the parity suite must catch: data parallelism averaging gradients on top of the global-token
    normalisation (every gradient divided by the data-parallel degree)."""
    from torch.distributed.fsdp import FSDPModule

    dp = trainer.parallel_dims.dp_degree
    fsdp_modules = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    for module in fsdp_modules:
        module.set_gradient_divide_factor(float(trainer.parallel_dims.fsdp_degree * trainer.parallel_dims.dp_replicate))
    if not fsdp_modules:  # DDP: swap our SUM hook for an averaging one before the first forward registers it
        from torch.distributed._composable.replicate import replicate

        state = replicate.state(trainer.model_parts[0])
        (hook_state, _), kwargs = state._comm_hook_args[0]

        def average_hook(hook_state, bucket):
            fut = dist.all_reduce(bucket.buffer().div_(dp), group=hook_state[0], async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        state._comm_hook_args[0] = ((hook_state, average_hook), kwargs)


FAULTS = {"nan_gradient": _nan_gradient, "average_gradients": _average_gradients}
