"""Data pipeline throughput (tokenize + pack + collate) against what training consumes.

    python scripts/benchmark_data.py [--seconds 8] [--workers 0,2] [--dp 1,8] [--debug-tps N]

Measures tokens/s per dp rank on the embedded corpus with the default BPE tokenizer (seq_len 2048,
local batch 8). Every rank reads the whole stream and keeps 1/dp of it, so the per-rank rate falls
as 1/dp. Consumption baselines, measured or computed in the same run:
  - the debug config (llama3 debugmodel, batch 4 x 256) forward+backward on this machine's CPU;
  - Llama 3 8B on one H100 at 40% MFU: 0.40 * 989e12 / flops_per_token(8B, seq 8192).
Prints "pipeline / consumption" ratios (> 1: the data never waits) and the largest dp degree at which
the per-rank rate still exceeds the 8B consumption.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

import torch  # noqa: E402

from torchtitan.tools import startup_gc  # noqa: E402

H100_BF16_PEAK = 989e12
MFU_8B = 0.40


def _source_and_tokenizer() -> tuple[object, object]:
    from torchtitan.data.datasets import build_document_source
    from torchtitan.data.tokenizer import build_tokenizer, default_cache_dir

    return build_document_source(dataset="python_stdlib", dataset_path=""), build_tokenizer("", default_cache_dir())


def pipeline_rate(source, tok, workers: int, dp: int, seq_len: int, batch: int, seconds: float) -> tuple[float, float]:
    """(per-rank tokens/s after the first batch, seconds to the first batch) for rank 0 of dp.

    The first batch includes build_dataloader's checks and starting the workers.
    """
    from torchtitan.data.dataloader import build_dataloader

    start = time.perf_counter()
    loader = build_dataloader(source=source, tokenizer=tok, seq_len=seq_len, local_batch_size=batch, dp_rank=0,
                              dp_degree=dp, num_workers=workers)  # fmt: skip
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    # The median of three windows: other processes on a shared machine distort a single one.
    rates = []
    for _ in range(3):
        t0, batches = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / 3:
            next(it)
            batches += 1
        rates.append(batches * batch * seq_len / (time.perf_counter() - t0))
    rate = sorted(rates)[1]
    del it
    loader.close()
    return rate, first


def debug_consumption(steps: int = 9) -> float:
    """Tokens/s of llama3 debugmodel forward+backward at the debug config's batch 4 x seq 256 on CPU."""
    from dataclasses import replace

    from torchtitan.models.llama3.args import llama3_flavors
    from torchtitan.models.llama3.model import Transformer

    b, s = 4, 256
    args = replace(llama3_flavors["debugmodel"], max_seq_len=s)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (b, s + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return b * s / sorted(times)[len(times) // 2]  # the median step: robust to other load on the machine


def h100_8b_consumption(seq_len: int = 8192) -> float:
    from dataclasses import replace

    from torchtitan.models.llama3.args import llama3_flavors
    from torchtitan.models.llama3.model import Transformer, get_nparams_and_flops

    args = replace(llama3_flavors["8B"], max_seq_len=seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    _, flops_per_token = get_nparams_and_flops(model, args, seq_len)
    return MFU_8B * H100_BF16_PEAK / flops_per_token


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measuring time per configuration")
    parser.add_argument("--workers", default="0,2", help="comma-separated num_workers values")
    parser.add_argument("--dp", default="1,8", help="comma-separated dp degrees (rank 0 is measured)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="local batch size")
    parser.add_argument("--debug-tps", type=float, default=None, help="debug-config tokens/s (skip measuring)")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    dps = [int(d) for d in args.dp.split(",")]

    source, tok = _source_and_tokenizer()
    debug_tps = args.debug_tps if args.debug_tps is not None else debug_consumption()
    h100_tps = h100_8b_consumption()
    print(f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, source {type(source).__name__}, seq_len {args.seq_len}, batch {args.batch}")
    print(f"consumption: debug config on this CPU {debug_tps:,.0f} tok/s; 8B on 1 H100 @ {MFU_8B:.0%} MFU "
          f"{h100_tps:,.0f} tok/s")
    print(f"{'workers':>7} {'dp':>3} {'start s':>8} {'tok/s/rank':>12} {'stream tok/s':>13} "
          f"{'/debug':>8} {'/8B H100':>9} {'max dp (8B)':>11}")
    for w in workers:
        for dp in dps:
            rate, first = pipeline_rate(source, tok, w, dp, args.seq_len, args.batch, args.seconds)
            stream = rate * dp  # each rank walks the whole stream
            print(f"{w:>7} {dp:>3} {first:>8.2f} {rate:>12,.0f} {stream:>13,.0f} {rate / debug_tps:>8.2f} "
                  f"{rate / h100_tps:>9.2f} {int(stream // h100_tps):>11}")


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
