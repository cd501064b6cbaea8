"""scripts/benchmark_trainer.py runs end to end on a tiny workload (its numbers are not checked: benchmarks print
ratios, tests never time), and its profile attributes forward and backward time to the model's components. Each
side trains one step after the one left out of the medians: the torchrun launches are what these tests cost."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.models.llama3 import model as llama

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "benchmark_trainer.py"
TINY = ["--", "--model.flavor", "debugmodel_small", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--metrics.log_freq", "2"]


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmark_trainer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list[str], tt_cache_dir) -> str:
    env = {**os.environ, "TORCHTITAN_CACHE_DIR": str(tt_cache_dir), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_profile_frames_map_to_components():
    direct = _load_script()._categorizer({"attention": [llama.Attention.forward], "rope": [llama.apply_rotary_emb]})
    code = llama.Attention.forward.__code__
    # the profiler names a Python frame by its path relative to the sys.path entry, its first line and its name
    assert direct(f"torchtitan/models/llama3/model.py({code.co_firstlineno}): forward") == "attention"
    rope = llama.apply_rotary_emb.__code__
    assert direct(f"torchtitan/models/llama3/model.py({rope.co_firstlineno}): apply_rotary_emb") == "rope"
    assert direct(f"torchtitan/models/llama3/model.py({code.co_firstlineno + 1}): forward") is None
    assert direct(f"elsewhere/model.py({code.co_firstlineno}): forward") is None
    assert direct("FSDP::pre_forward") == "fsdp"
    assert direct("torch/optim/adam.py(214): step") == "optimizer"
    assert direct("torch/nn/functional.py(3472): cross_entropy") == "loss"
    assert direct("aten::mm") is None


def test_compare_prints_both_sides_and_their_ratio(tt_cache_dir):
    out = _run(["--nproc", "1", "--rounds", "1", "--steps", "2", "--warmup", "1", *TINY], tt_cache_dir)
    rates = {side: float(m) for side, m in re.findall(r"^\s+(trainer|bare loop)\s+([\d.]+) tokens/s", out, re.M)}
    assert set(rates) == {"trainer", "bare loop"} and all(r > 0 for r in rates.values()), out
    ratio = float(re.search(r"trainer / bare = ([\d.]+)", out).group(1))
    assert ratio == pytest.approx(rates["trainer"] / rates["bare loop"], abs=2e-3), out


def test_profile_attributes_the_step_to_model_components(tt_cache_dir):
    # One traced step after the first (which builds FSDP's state lazily): every component shows in each step.
    out = _run(["--profile", "--nproc", "2", "--steps", "2", "--warmup", "1", *TINY], tt_cache_dir)
    rows = re.findall(r"^\s+([a-z+]+)\s+([\d.]+)%\s+(\d+) ops$", out, re.M)
    shares = {name: float(pct) for name, pct, _ in rows}
    ops = {name: int(n) for name, _, n in rows}
    assert sum(shares.values()) == pytest.approx(100.0, abs=0.5), out
    # every part of the model is found, forward and backward, and FSDP's collectives on 2 processes
    for component in ("attention", "rope", "mlp", "norms", "embedding+output", "loss", "optimizer", "fsdp"):
        assert shares[component] > 0.0 and ops[component] > 0, (component, out)
    # Most of what the step runs is attributed. Counted in profiled events, not time: the time shares move with the
    # machine's load ("other" measured 8-28% of the time on the same program, 6.4% of the events).
    assert ops["other"] < 0.15 * sum(ops.values()), out
