"""What every decoder family here shares: the parameter-init contract, RMSNorm, the swappable attention core, the
SwiGLU MLP, a pre-norm block whose MLP is dense or a mixture of experts, and the decoder skeleton.

A family (torchtitan/models/llama3, qwen3, deepseek_v3) subclasses `Decoder` with its block and its rotary table.
Parallelism is applied from outside by submodule name, so these names are a contract for every family:
`tok_embeddings`, `layers` ("0", "1", ...), `norm`, `output`, and per block `attention_norm`, `attention` (with
its `sdpa` core), `ffn_norm`, then `feed_forward` (dense) or `moe`. Plain modules: no torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtitan.components.loss import cross_entropy_sum
from torchtitan.models.attention import document_causal_mask
from torchtitan.models.moe import MoE
from torchtitan.models.random_fill import Constant, Normal, TruncNormal

ParamInit = Callable[[torch.Tensor, Callable[[torch.Tensor], object]], None]
"""(parameter, fill_fn) -> None. The caller decides how fill_fn reaches the parameter's storage."""


def default_param_init(param: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    fill(param)


def trunc_normal(std: float) -> TruncNormal:
    # Cut at +-3 std so that no single weight starts as an outlier. Its values depend only on (seed, element), so a
    # rank can fill its shard alone (torchtitan/models/random_fill.py).
    return TruncNormal(std)


class RMSNorm(nn.Module):
    """Root-mean-square norm, always computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm accumulates the mean of squares in fp32 for bf16 inputs and has fused kernels
        # (CPU and CUDA) when input and weight share a dtype. Under autocast the weight stays fp32 while x is
        # bf16: normalise in fp32 then, as the fused kernel would, rather than fall back to its slow path.
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def init_weights(self, param_init: ParamInit) -> None:
        param_init(self.weight, Constant(1.0))


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over [batch, heads, seq, head_dim], causal, and within each document when
    `document_ids` ([batch, seq]) is given. Its own module so that context parallel can replace it by attention over
    the whole (sharded) sequence (torchtitan/distributed/context_parallel.py)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Grouped-query heads go to SDPA as they are (query head h reads kv head h // (q heads / kv heads)):
        # no expanded copies of K and V in memory, and the flash kernels take the grouping natively.
        gqa = q.shape[1] != k.shape[1]
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # An explicit mask (flex attention has no CPU backward): SDPA keeps a float copy of it, batch x seq^2
        # elements per layer, for the backward (docs/parallelism.md, document masking).
        mask = document_causal_mask(document_ids, document_ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float, param_init: ParamInit) -> None:
        param_init(self.w1.weight, trunc_normal(0.02))
        param_init(self.w2.weight, trunc_normal(out_std))
        param_init(self.w3.weight, trunc_normal(out_std))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: `attention` (the family's), then a SwiGLU MLP (`feed_forward`) or a mixture of
    experts (`moe`, where the args say so: `model_args.moe` and `model_args.is_moe_layer(layer_id)`)."""

    def __init__(self, layer_id: int, model_args: Any, attention: nn.Module) -> None:
        super().__init__()
        # Kept on the block (not derived from its key in `layers`) so a pipeline stage holding
        # only some of the layers still initialises each one as the full model would.
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        moe_args = getattr(model_args, "moe", None)
        self.moe_enabled = moe_args is not None and model_args.is_moe_layer(layer_id)
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if self.moe_enabled:
            self.moe = MoE(model_args.dim, moe_args)
        else:
            self.feed_forward = FeedForward(model_args.dim, model_args.ffn_hidden_dim)
        # Residual-branch outputs add up over the depth; shrinking their init keeps the residual
        # stream's variance from growing with the number of layers.
        depth = (layer_id + 1) if model_args.depth_init else model_args.n_layers
        self.weight_init_std = 0.02 / math.sqrt(2 * depth)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                cache: Any = None) -> torch.Tensor:
        """`cache`: this layer's part of a generation KV cache (a LayerCache of torchtitan/generation/kv_cache.py), or
        None."""
        if cache is None:
            h = x + self.attention(self.attention_norm(x), freqs_cis, document_ids)
        else:  # by keyword: tensor parallel's input hooks on `attention` take its three positional inputs only
            h = x + self.attention(self.attention_norm(x), freqs_cis, document_ids, cache=cache)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + mlp(self.ffn_norm(h))

    def init_weights(self, param_init: ParamInit) -> None:
        self.attention_norm.init_weights(param_init)
        self.attention.init_weights(self.weight_init_std, param_init)
        self.ffn_norm.init_weights(param_init)
        (self.moe if self.moe is not None else self.feed_forward).init_weights(self.weight_init_std, param_init)


class OutputProjection(nn.Linear):
    """The projection to the vocabulary, [.., dim] -> logits [.., vocab]; given `labels`, the cross-entropy sum
    over them instead, computed in `loss_chunks` chunks of tokens so that full-vocabulary logits never exist at
    once (docs/performance.md, "Chunked loss"). Training with more than one chunk recomputes each chunk's logits
    in the backward (one more forward matmul of this layer) rather than keeping them."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.loss_chunks = 1
        # logits [tokens, vocab], labels [tokens] -> loss sum; the trainer may swap in a compiled one
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum
        # What a chunk's logits go through before the loss: tensor parallel without loss parallel gathers the
        # vocab-sharded logits here (torchtitan/distributed/tensor_parallel.py, OutputParallel).
        self.logits_to_loss: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        h, labels = h.flatten(0, -2), labels.flatten()
        chunks = max(1, min(self.loss_chunks, h.shape[0]))
        if chunks == 1:
            return self._chunk_loss(h, self.weight, labels)
        size = -(-h.shape[0] // chunks)
        total = None
        for h_chunk, labels_chunk in zip(h.split(size), labels.split(size), strict=True):
            # The weight goes in as an argument: under FSDP it is the gathered parameter, whose storage the
            # backward gathers again before the recompute reads it.
            loss = (checkpoint(self._chunk_loss, h_chunk, self.weight, labels_chunk, use_reentrant=False,
                               preserve_rng_state=False)
                    if torch.is_grad_enabled() else self._chunk_loss(h_chunk, self.weight, labels_chunk))
            total = loss if total is None else total + loss
        return total

    def _chunk_loss(self, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, weight)
        return self.loss_fn(logits if self.logits_to_loss is None else self.logits_to_loss(logits), labels)


class Decoder(nn.Module):
    """Decoder skeleton: tokens [B, S] -> logits [B, S, vocab]. A family gives its block class
    (`block_cls(layer_id, model_args)`) and its rotary table (`rope_table`).

    Pipeline stages are cut by setting `tok_embeddings`, `norm` or `output` to None and deleting
    entries of `layers`; a stage without embeddings takes hidden states [B, S, dim] as input and a
    stage without output returns hidden states.
    """

    def __init__(self, model_args: Any, block_cls: Callable[[int, Any], nn.Module]) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict({str(i): block_cls(i, model_args) for i in range(model_args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output: OutputProjection | None = OutputProjection(model_args.dim, model_args.vocab_size)
        if model_args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: it is a pure function of the config, so checkpoints need not carry it.
        # On the meta device this has no values; init_weights fills it in.
        self.register_buffer("freqs_cis", self.rope_table(None), persistent=False)

    def rope_table(self, device: torch.device | None) -> torch.Tensor:
        """The family's rotary table, [max_seq_len, rotary dim // 2, 2] (cos, sin)."""
        raise NotImplementedError

    def _default_buffer_device(self) -> torch.device:
        if self.tok_embeddings is not None:
            return self.tok_embeddings.weight.device
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _restore_tie(self) -> None:
        # Module.to_empty() materialises each module's parameters separately, which silently
        # turns a shared weight into two (unless swap_module_params_on_conversion is enabled).
        emb, out = self.tok_embeddings, self.output
        if self.model_args.tie_word_embeddings and emb is not None and out is not None and out.weight is not emb.weight:
            out.weight = emb.weight

    def init_weights(
        self,
        buffer_device: torch.device | None = None,
        param_init: ParamInit | None = None,
    ) -> None:
        """Fill every parameter exactly once, in registration order, and rebuild `freqs_cis` (MoE layers also zero
        their balancing buffers).

        Order: tok_embeddings, then each block (attention_norm, the attention's projections and norms, ffn_norm,
        then the MLP or the MoE's router, experts and shared experts), then norm, then output (skipped when it is
        the tied embedding). This equals the order of `self.parameters()`, so a seeded, order-dependent
        param_init is reproducible. Parameters added by a model converter (LoRA's adapters) come last, filled by
        their modules' `init_adapter_weights(param_init)`.
        """
        fill = param_init if param_init is not None else default_param_init
        device = buffer_device if buffer_device is not None else self._default_buffer_device()
        with torch.no_grad():
            self.freqs_cis = self.rope_table(device)
            self._restore_tie()
            tied = (
                self.output is not None
                and self.tok_embeddings is not None
                and (self.output.weight is self.tok_embeddings.weight)
            )
            if self.tok_embeddings is not None:
                # Untied: std 1.0 like the Llama references. The embedding feeds an RMSNorm
                # straight away, so its scale only sets how strongly token identity dominates the
                # early residual stream relative to the small (std 0.02) block outputs.
                # Tied: the matrix is also the output projection, where std 1.0 would give initial
                # logits of std ~sqrt(dim); use the output rule instead.
                if tied:
                    fill(self.tok_embeddings.weight, trunc_normal(self.model_args.dim**-0.5))
                else:
                    fill(self.tok_embeddings.weight, Normal(1.0))
            for layer in self.layers.values():
                layer.init_weights(fill)
            if self.norm is not None:
                self.norm.init_weights(fill)
            if self.output is not None and not tied:
                # std dim**-0.5 makes initial logits roughly unit variance given a unit-RMS input.
                fill(self.output.weight, trunc_normal(self.model_args.dim**-0.5))
            # Parameters a model converter added (LoRA adapters, torchtitan/components/quantization/lora.py) are
            # filled by their module, through the same param_init, so every layout initialises them alike.
            for module in self.modules():
                if hasattr(module, "init_adapter_weights"):
                    module.init_adapter_weights(fill)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                cache: Any = None) -> torch.Tensor:
        """`tokens` [batch, seq] (or a pipeline stage's hidden states).
        `positions`: the tokens' rotary positions when they are not 0 .. seq - 1: [seq] (context parallel holds two
        chunks of each sequence) or [batch, seq] (document masking restarts them in every document).
        `document_ids` [batch, seq]: attention stays within each document (packed sequences); under context
        parallel the whole sequence's ids, since its attention reads every rank's keys.
        `labels` [batch, seq]: return the cross-entropy sum over them rather than the logits (a stage without the
        output projection ignores them: the pipeline hands every stage the same inputs).
        `cache`: generation's KVCache (torchtitan/generation/kv_cache.py): the tokens continue what it holds, each
        block reads and extends its layer's part, `positions` default to the cache's per-row ones, and only the last
        position's logits are returned ([batch, 1, vocab]: all generation needs, where a long prompt's full logits
        could outweigh the model)."""
        # The whole rotary table goes to the blocks, which take the rows they need from the sequence length inside
        # attention: a pipeline stage's input may be a sequence-sharded activation (tensor parallel), whose
        # length is not the sequence's.
        if tokens.dim() == 2 and tokens.shape[1] > self.freqs_cis.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.freqs_cis.shape[0]}")
        if cache is not None:
            if document_ids is not None or labels is not None:
                raise ValueError("a KV cache takes neither document_ids nor labels")
            slot_positions = cache.reserve(tokens.shape[1])  # also fixes this forward's cache slots and mask
            positions = slot_positions if positions is None else positions
        rope = self.freqs_cis if positions is None else self.freqs_cis[positions]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if cache is None:
            for layer in self.layers.values():
                h = layer(h, rope, document_ids)
        else:
            for key, layer in self.layers.items():
                h = layer(h, rope, cache=cache.layer(key))
            h = h[:, -1:]  # the norm and the output projection act per position: the last one is all we need
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        # labels by keyword: tensor parallel's hooks on `output` take and return the positional hidden states only
        return self.output(h) if labels is None else self.output(h, labels=labels)
