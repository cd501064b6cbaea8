"""Checkpoint save/load throughput against the disk's raw sequential speed, measured in one run.

    python scripts/benchmark_checkpoint.py [--dir /path/on/the/target/disk] [--dim 1024 --n-layers 4 --vocab 16384]

Builds a Llama model (default ~80M parameters) with AdamW state (params + 2 moments: ~0.96 GB fp32) and
times, on the same disk:
  raw write   the same tensors' bytes written sequentially to one file, then fsync
  raw read    that file read back into preallocated tensors, page cache evicted first
  save        CheckpointManager with async_mode=disabled (DCP save, fsync'd files, completion marker)
  async       CheckpointManager with async_mode=async: the training stall (until maybe_save returns: staging
              copy) and the time until the checkpoint is complete (wait() returns)
  load        CheckpointManager.load() of the sync checkpoint, page cache evicted first
Ratios are against the raw write (saves) or raw read (loads). Single process, CPU tensors.
Then the Hugging Face export and import of the model weights (float32), by rows (hf_sharded.py, what the trainer
uses) against the whole-state-dict functions (hf_io.save_hf / load_hf + load_state_dict), page cache evicted
before each import.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

import torch  # noqa: E402

from torchtitan.components.checkpoint import CheckpointManager, TrainState  # noqa: E402
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models.llama3.args import llama3_flavors  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.tools import startup_gc  # noqa: E402

CHUNK = 64 << 20


def evict(path: Path) -> bool:
    """Drop a file's (or a folder's files') pages from the page cache, so reads come from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for state in opt.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def raw_write(path: Path, tensors: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_read(path: Path, tensors: list[torch.Tensor]) -> float:
    dest = [torch.empty_like(t) for t in tensors]
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for t in dest:
            view = memoryview(t.view(torch.uint8).numpy())
            for start in range(0, len(view), CHUNK):
                f.readinto(view[start:start + CHUNK])
    return time.perf_counter() - t0


def build(args, seed: int):
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # creates the two moments per parameter
    opt.zero_grad(set_to_none=True)
    return model, opt


def manager(root: Path, model, opt, mode: str) -> CheckpointManager:
    cfg = Checkpoint(enable=True, interval=1, async_mode=mode, keep_latest_k=0)
    return CheckpointManager(cfg, dump_folder=root, model_parts=[model], optimizer=opt, lr_scheduler=None,
                             dataloader=None, train_state=TrainState(step=1), model_args=None, world_size=1, rank=0)


def hf_round(root: Path, model, args, best) -> None:
    """One export and import each way; the imports must give the model's weights back."""
    from torchtitan.components.hf_io import load_hf, save_hf
    from torchtitan.components.hf_sharded import load_hf_sharded, save_hf_sharded

    sd = model.state_dict()
    for name, save in (("save_hf (whole state dict)", save_hf), ("export by rows", save_hf_sharded)):
        t0 = time.perf_counter()
        save(root / name, sd, args, model="llama3")
        best(name, time.perf_counter() - t0)
    for name, folder in (("load_hf + load_state_dict", "save_hf (whole state dict)"),
                         ("import by rows", "export by rows")):
        evict(root / folder)
        fresh = Transformer(args)
        t0 = time.perf_counter()
        if name == "import by rows":
            load_hf_sharded(root / folder, [fresh], args, model="llama3")
        else:
            fresh.load_state_dict(load_hf(root / folder, args)[0])
        best(name, time.perf_counter() - t0)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    for folder in ("save_hf (whole state dict)", "export by rows"):
        shutil.rmtree(root / folder)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=2, help="best of N for every measurement")
    ns = p.parse_args(argv)
    args = dataclasses.replace(llama3_flavors["debugmodel"], dim=ns.dim, n_layers=ns.n_layers, n_heads=16,
                               n_kv_heads=8, vocab_size=ns.vocab, max_seq_len=64)
    model, opt = build(args, 0)
    tensors = tensors_of(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    gb = nbytes / 1e9
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=ns.dir))
    results: dict[str, float] = {}
    hf: dict[str, float] = {}

    def best(name: str, seconds: float) -> None:
        results[name] = min(results.get(name, float("inf")), seconds)

    def best_hf(name: str, seconds: float) -> None:
        hf[name] = min(hf.get(name, float("inf")), seconds)

    try:
        cold = True
        for r in range(ns.repeats):
            raw = root / "raw.bin"
            best("raw write + fsync", raw_write(raw, tensors))
            cold &= evict(raw)
            best("raw read", raw_read(raw, tensors))
            raw.unlink()

            mgr = manager(root / f"sync{r}", model, opt, "disabled")
            t0 = time.perf_counter()
            mgr.maybe_save(1)
            best("DCP save (sync)", time.perf_counter() - t0)
            mgr.close()

            mgr = manager(root / f"async{r}", model, opt, "async")
            t0 = time.perf_counter()
            mgr.maybe_save(1)
            best("DCP async: training stall", time.perf_counter() - t0)
            mgr.wait()
            best("DCP async: until complete", time.perf_counter() - t0)
            mgr.close()
            shutil.rmtree(root / f"async{r}")

            cold &= evict(root / f"sync{r}")
            m2, o2 = build(args, 1)
            mgr = manager(root / f"sync{r}", m2, o2, "disabled")
            t0 = time.perf_counter()
            assert mgr.load()
            best("DCP load", time.perf_counter() - t0)
            mgr.close()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters(), strict=True))
            del m2, o2
            shutil.rmtree(root / f"sync{r}")
            hf_round(root, model, args, best_hf)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"checkpoint benchmark: {gb:.3f} GB of model+AdamW state ({sum(p.numel() for p in model.parameters()):,} "
          f"params), best of {ns.repeats}, {os.cpu_count()} CPUs, {platform.platform()}, torch {torch.__version__}")
    print(f"disk folder: {ns.dir or tempfile.gettempdir()}; reads {'cold (page cache evicted)' if cold else 'WARM'}")
    print(f"{'':28s} {'seconds':>8s} {'GB/s':>7s} {'vs raw':>7s}")
    for name, sec in results.items():
        base = results["raw read"] if "read" in name or "load" in name else results["raw write + fsync"]
        print(f"{name:28s} {sec:8.3f} {gb / sec:7.2f} {base / sec:7.2f}x")
    model_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"\nHugging Face folder of the weights ({model_gb:.3f} GB float32)  {'seconds':>8s} {'GB/s':>7s} "
          f"{'vs whole':>8s}")
    for name, sec in hf.items():
        whole = "save_hf (whole state dict)" if "save" in name or "export" in name else "load_hf + load_state_dict"
        base = hf[whole]
        print(f"{name:48s} {sec:8.3f} {model_gb / sec:7.2f} {base / sec:7.2f}x")


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    main()
