"""The output projection scores labels in token chunks (torchtitan/models/decoder.py, OutputProjection): the loss
and every gradient equal scoring the whole logits at once, full-vocabulary logits never exist at once (measured from
the allocator), and training.loss_chunks = 0 picks the count from the logits' size. The multi-rank layouts (FSDP, TP
with and without loss parallel, the pipeline's last stage) are parity layouts (tests/integration/layouts.py,
CHUNKED_LOSS)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.components.model_parts import AUTO_LOSS_CHUNK_BYTES, loss_chunks
from torchtitan.config.manager import load_config
from torchtitan.models.decoder import OutputProjection
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.tools.profiling import allocator_peak


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    args = llama3_flavors["debugmodel_small"]
    model = Transformer(args)
    model.init_weights()
    return model


def _batch(vocab: int, batch: int = 3, seq: int = 20, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :] = IGNORE_INDEX  # a whole chunk of ignored targets
    labels[2, 5:9] = IGNORE_INDEX
    return tokens, labels


def _loss_and_grads(model, tokens, labels, chunks: int | None):
    model.zero_grad(set_to_none=True)
    if chunks is None:  # the reference: every token's logits at once, then the loss
        loss = cross_entropy_sum(model(tokens), labels)
    else:
        model.output.loss_chunks = chunks
        loss = model(tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunks", [1, 3, 7, 1000])
def test_chunked_loss_and_gradients_equal_the_whole_logits(chunks):
    model = _model()
    tokens, labels = _batch(model.model_args.vocab_size)
    ref_loss, ref_grads = _loss_and_grads(model, tokens, labels, None)
    loss, grads = _loss_and_grads(model, tokens, labels, chunks)  # 1000 chunks: one per token (60)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    # fp32 sums in another order: measured at most 6.5e-7 of a tensor's norm (one chunk per token)
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() <= 5e-6 * ref_grads[name].norm(), name


def test_chunked_loss_without_gradients_and_under_bf16_autocast():
    model = _model()
    tokens, labels = _batch(model.model_args.vocab_size)
    with torch.no_grad():
        ref = cross_entropy_sum(model(tokens), labels)
        model.output.loss_chunks = 4
        torch.testing.assert_close(model(tokens, labels=labels), ref, rtol=1e-6, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.output.loss_chunks = 1
            whole = model(tokens, labels=labels)
            model.output.loss_chunks = 4
            chunked = model(tokens, labels=labels)
    assert whole.dtype == chunked.dtype == torch.float32  # the loss is always computed in fp32
    # bf16 logits of a chunk are the same matmul rows as the whole: only the fp32 sum's order differs
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=0)


def _allocator_peak(fn) -> int:
    """Highest sum of live bytes allocated while `fn` runs (the profiler's allocator events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocator_peak(prof)


@pytest.mark.parametrize("grad", [True, False])
def test_full_vocabulary_logits_never_exist_at_once(grad):
    # A projection whose logits dwarf everything else: 512 tokens x 8192 vocabulary x 4 bytes = 16 MiB per copy.
    torch.manual_seed(0)
    tokens, dim, vocab, chunks = 512, 32, 8192, 8
    out = OutputProjection(dim, vocab)
    h = torch.randn(tokens, dim, requires_grad=grad)
    labels = torch.randint(0, vocab, (tokens,))
    logits_bytes = tokens * vocab * 4

    def step(n: int) -> None:
        out.loss_chunks = n
        with torch.set_grad_enabled(grad):
            loss = out(h, labels=labels)
            if grad:
                loss.backward()
        out.weight.grad = h.grad = None

    whole, chunked = _allocator_peak(lambda: step(1)), _allocator_peak(lambda: step(chunks))
    # Whole: the logits and their log-softmax (kept for the backward, or its input's gradient) at least.
    assert whole >= 2 * logits_bytes, (whole, logits_bytes)
    # Chunked: a few copies of one chunk's logits, plus the weight's gradient (1 MiB) and small tensors. Keeping
    # every chunk's logits for the backward (no recompute) would hold 2 x 16 MiB again.
    assert chunked <= 4 * logits_bytes / chunks + 2 * vocab * dim * 4, (chunked, logits_bytes)


def _chunks(*args: str, world: int = 1, vocab: int = 128_256) -> int:
    cfg, resolved = load_config(["--model.flavor", "debugmodel", *args], world)
    return loss_chunks(cfg, resolved.parallel_dims, resolved.pipeline, vocab)


def test_auto_chunk_count_follows_the_logits_size():
    # 8192 tokens x 128,256 x 4 bytes = 4.0 GiB of fp32 logits: 16 chunks of at most 256 MiB
    assert AUTO_LOSS_CHUNK_BYTES == 256 * 2**20
    assert _chunks("--training.seq_len", "8192", "--training.local_batch_size", "1") == 16
    assert _chunks("--training.seq_len", "8192", "--training.local_batch_size", "2") == 32
    # loss parallel scores a quarter of the vocabulary per rank; without it each rank gathers all of it
    tp4 = ("--training.seq_len", "8192", "--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree",
           "4")
    assert _chunks(*tp4, world=4) == 4
    assert _chunks(*tp4, "--parallelism.disable_loss_parallel", "true", world=4) == 16
    # context parallel: each rank's half of the sequence; pipeline: one micro-batch of the local batch
    assert _chunks("--training.seq_len", "8192", "--training.local_batch_size", "1",
                   "--parallelism.context_parallel_degree", "2", world=2) == 8
    assert _chunks("--training.seq_len", "8192", "--training.local_batch_size", "4",
                   "--parallelism.pipeline_parallel_degree", "2", world=2) == 16
    # small logits: one chunk, the whole logits at once (no recompute)
    assert _chunks("--training.seq_len", "256", "--training.local_batch_size", "8", vocab=8192) == 1
    # an explicit count is taken as it is
    assert _chunks("--training.loss_chunks", "3") == 3
