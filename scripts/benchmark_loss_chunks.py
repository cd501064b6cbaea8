"""The output projection and cross-entropy in token chunks against the whole logits, side by side in one run: the
time of one forward + backward of the projection and loss, its ratio to one chunk, the peak memory of that step
and its ratio (docs/performance.md, "Chunked loss").

    python scripts/benchmark_loss_chunks.py [--tokens 8192 --dim 4096 --vocab 128256] [--chunks 1,2,4,8,16,32]
        [--dtype bfloat16] [--device cuda] [--repeats 10]

The defaults are the Llama 3 8B output layer at seq 8192 and local batch 1 (the GPU workload of issue 29); on a CPU
pick a smaller shape. Peak memory: torch.cuda.max_memory_allocated on a GPU, the profiler's allocator events on a
CPU; both count only what the step allocates beyond its inputs (hidden states, labels, weight).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

import torch  # noqa: E402

from torchtitan.models.decoder import OutputProjection  # noqa: E402
from torchtitan.tools import startup_gc  # noqa: E402
from torchtitan.tools.profiling import allocator_peak  # noqa: E402


def _cpu_peak(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return allocator_peak(prof)


def measure(tokens: int, dim: int, vocab: int, chunks: int, dtype: torch.dtype, device: torch.device,
            repeats: int) -> tuple[float, int]:
    """(median seconds of a forward + backward, peak bytes allocated by one) for `chunks` token chunks."""
    torch.manual_seed(0)
    out = OutputProjection(dim, vocab).to(device)
    out.loss_chunks = chunks
    h = torch.randn(tokens, dim, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device=device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step() -> None:
        with autocast:
            loss = out(h, labels=labels)
        loss.backward()
        out.weight.grad = h.grad = None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: kernels chosen, allocator pools filled
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = _cpu_peak(step)
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (batch x seq)")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--chunks", default="1,2,4,8,16,32", help="comma-separated chunk counts, 1 first")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="autocast dtype of the projection (the loss is always fp32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    print(f"output projection + loss: {args.tokens} tokens x dim {args.dim} -> vocab {args.vocab}, {args.dtype}, "
          f"{device}")
    print(f"{'chunks':>6} {'ms':>9} {'time ratio':>10} {'peak MiB':>9} {'peak ratio':>10}")
    for chunks in (int(c) for c in args.chunks.split(",")):
        seconds, peak = measure(args.tokens, args.dim, args.vocab, chunks, dtype, device, args.repeats)
        first = rows[0] if rows else {"seconds": seconds, "peak_bytes": peak}
        rows.append({"chunks": chunks, "seconds": seconds, "peak_bytes": peak,
                     "time_ratio": seconds / first["seconds"], "peak_ratio": peak / first["peak_bytes"]})
        print(f"{chunks:6d} {1000 * seconds:9.2f} {rows[-1]['time_ratio']:10.2f} {peak / 2**20:9.1f} "
              f"{rows[-1]['peak_ratio']:10.2f}", flush=True)
    return rows


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
