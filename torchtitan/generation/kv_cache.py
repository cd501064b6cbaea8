"""The key/value cache of generation: plain tensors, filled by the models' attention modules.

One `KVCache` serves one batch of rows for one generation. It holds, per layer (`layer(key)`, keyed as the model's
`layers`), a `LayerCache` of whatever that layer's attention stores per token, and, for all layers together, the
bookkeeping a forward needs: which slots this forward writes, each row's rotary positions, and the attention mask.

Layout: rows are left-padded to a common prompt length, so every row writes the same slots at every step (one
slice assignment per tensor, no scatter). Row b's first `pad[b]` slots are padding: its rotary positions start at 0
on its first real token, and no real token attends to a padding slot. A padding slot attends only to itself, which
keeps its (unused) values finite: a fully masked softmax row would be NaN, and 0 x NaN would leak into real rows.

The protocol the models use (torchtitan/models/decoder.py passes `cache.layer(key)` to each block):
  * `Decoder.forward` calls `cache.reserve(seq_len)` once, before its blocks: it returns the new tokens' positions
    [batch, seq_len] and fixes the slots [start, end) and the mask for this forward;
  * an attention module calls `layer_cache.update(*tensors)` with its new per-token tensors, sequence on dim -2
    ([batch, heads, seq, head_dim] for keys and values, [batch, seq, width] for MLA's latent), and gets back every
    slot written so far, [..., end, ...]; then it attends with `attn_mask` (boolean [batch or 1, 1, seq, end], True =
    attend) or `is_causal`, whichever the cache sets (never both).
Buffers are allocated on a layer's first update, in the dtype and device of what it writes, for all `max_len` slots.

What each family stores per token and layer: Llama 3 and Qwen3 their rotated keys and values (2 x kv_heads x
head_dim); DeepSeek-V3 its normalised kv latent and rotated shared rope key (kv_lora_rank + qk_rope_head_dim),
never the per-head keys and values (docs/generation.md).
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's cached tensors, each [..., max_len, width] with the sequence on dim -2."""

    def __init__(self, owner: KVCache) -> None:
        self._owner = owner
        self.buffers: tuple[torch.Tensor, ...] = ()

    @property
    def attn_mask(self) -> torch.Tensor | None:
        return self._owner.attn_mask

    @property
    def is_causal(self) -> bool:
        return self._owner.is_causal

    @property
    def start(self) -> int:
        """The first slot this forward writes: 0 on the prompt's forward (nothing cached before it)."""
        return self._owner.start

    def update(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write `new` (one tensor per cached quantity, [..., seq, width]) into this forward's slots and return each
        quantity's slots 0 .. end, views of the buffers."""
        start, end = self._owner.start, self._owner.end
        if not self.buffers:
            self.buffers = tuple(t.new_empty((*t.shape[:-2], self._owner.max_len, t.shape[-1])) for t in new)
        if len(new) != len(self.buffers):
            raise ValueError(f"this layer cached {len(self.buffers)} tensors per token, now given {len(new)}")
        out = []
        for buf, t in zip(self.buffers, new, strict=True):
            if t.shape[-2] != end - start or t.shape[:-2] != buf.shape[:-2] or t.shape[-1] != buf.shape[-1]:
                raise ValueError(f"cache update of shape {tuple(t.shape)} does not fit slots {start}:{end} of a "
                                 f"buffer {tuple(buf.shape)}")
            buf[..., start:end, :] = t
            out.append(buf[..., :end, :])
        return tuple(out)

    def elements_per_token(self) -> int:
        """Cached elements per token and row of this layer (0 before the first update)."""
        return sum(b[..., 0, :].numel() // b.shape[0] for b in self.buffers)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class KVCache:
    """The cache of a batch of `len(pad)` rows over `max_len` slots; row b's first `pad[b]` slots are padding
    (left-padded prompts). Positions, slots and the mask are the same for every layer of a forward."""

    def __init__(self, pad: torch.Tensor, max_len: int) -> None:
        if pad.dim() != 1:
            raise ValueError(f"pad: expected [batch], got shape {tuple(pad.shape)}")
        if max_len <= 0 or (pad.numel() and int(pad.max()) >= max_len):
            raise ValueError(f"max_len {max_len} leaves no slot for a real token")
        self.pad = pad.long()
        self.max_len = max_len
        self.padded = bool((self.pad > 0).any())
        self.layers: dict[str, LayerCache] = {}
        self.start = 0  # slots [start, end) are the current forward's
        self.end = 0
        self.attn_mask: torch.Tensor | None = None
        self.is_causal = False

    @property
    def batch_size(self) -> int:
        return self.pad.shape[0]

    @property
    def length(self) -> int:
        """Slots filled so far (padding included)."""
        return self.end

    def layer(self, key: str) -> LayerCache:
        if key not in self.layers:
            self.layers[key] = LayerCache(self)
        return self.layers[key]

    def reserve(self, seq_len: int) -> torch.Tensor:
        """Claim the next `seq_len` slots for the coming forward, set its mask, and return the new tokens' rotary
        positions [batch, seq_len] (slot - pad, clamped at 0 on padding)."""
        start, end = self.end, self.end + seq_len
        if seq_len <= 0 or end > self.max_len:
            raise ValueError(f"cannot add {seq_len} tokens to a cache holding {start} of {self.max_len} slots")
        self.start, self.end = start, end
        slots = torch.arange(start, end, device=self.pad.device)
        self.attn_mask, self.is_causal = None, False
        if not self.padded and start == 0:
            self.is_causal = seq_len > 1  # the prompt: plain causal attention, the kernels' fast path
        elif self.padded or seq_len > 1:
            keys = torch.arange(end, device=self.pad.device)
            visible = keys.view(1, 1, -1) <= slots.view(1, -1, 1)  # causal, [1, seq, end]
            if self.padded:
                real = keys.view(1, 1, -1) >= self.pad.view(-1, 1, 1)  # [batch, 1, end]
                visible = visible & (real | (keys.view(1, 1, -1) == slots.view(1, -1, 1)))
            self.attn_mask = visible.unsqueeze(1)  # [batch or 1, 1, seq, end]
        # (one token without padding: it sees every filled slot, no mask needed)
        return (slots.view(1, -1) - self.pad.view(-1, 1)).clamp(min=0)

    def elements_per_token(self) -> int:
        """Cached elements per token and row, summed over the layers."""
        return sum(c.elements_per_token() for c in self.layers.values())

    def nbytes(self) -> int:
        """Bytes held by the buffers (all `max_len` slots of every row)."""
        return sum(c.nbytes() for c in self.layers.values())
