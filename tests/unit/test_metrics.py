"""Unit tests for torchtitan.tools.device and torchtitan.components.metrics (CPU only)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.components import metrics as metrics_mod
from torchtitan.components.metrics import MetricsLogger
from torchtitan.tools import device
from torchtitan.tools.device import MemoryMonitor, peak_flops
from torchtitan.tools.logging import logger as tt_logger

# --------------------------------------------------------------------------- peak FLOPS


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100-SXM5-80GB", 989.4e12),
        ("NVIDIA H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H200 NVL", 835.5e12),
        ("NVIDIA GH200 480GB", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362.05e12),
        ("NVIDIA L40", 181.05e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("AMD Instinct MI300X", 1307.4e12),
        ("AMD Instinct MI300X VF", 1307.4e12),
        ("AMD Instinct MI325X", 1307.4e12),
        ("AMD Instinct MI250X", 191.5e12),
    ],
)
def test_peak_flops_bf16_known_devices(name: str, expected: float) -> None:
    assert peak_flops(name, torch.bfloat16) == pytest.approx(expected)
    # fp16 runs on the same tensor cores at the same rate.
    assert peak_flops(name, torch.float16) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "tf32", "fp32"),
    [
        ("NVIDIA H100 80GB HBM3", 494.7e12, 67e12),
        ("NVIDIA H100 PCIe", 378.0e12, 51e12),
        ("NVIDIA H100 NVL", 417.5e12, 60e12),
        ("NVIDIA H200", 494.7e12, 67e12),
        ("NVIDIA GH200 480GB", 494.7e12, 67e12),
        ("NVIDIA A100-SXM4-80GB", 156e12, 19.5e12),
        ("NVIDIA L40S", 183e12, 91.6e12),
        ("NVIDIA L4", 60e12, 30.3e12),
        ("NVIDIA B200", 1.1e15, None),  # no checked plain-FP32 figure: no MFU rather than a guess
        ("AMD Instinct MI300X", None, 163.4e12),  # ROCm: TF32 is never switched on, fp32 = FP32 matrix
        ("AMD Instinct MI250X", None, 47.85e12),
    ],
)
def test_peak_flops_fp32_follows_tf32(name: str, tf32: float | None, fp32: float | None) -> None:
    assert peak_flops(name, torch.float32, tf32=True) == (None if tf32 is None else pytest.approx(tf32))
    assert peak_flops(name, torch.float32, tf32=False) == (None if fp32 is None else pytest.approx(fp32))
    # bf16 params run on the half-precision tensor cores whatever the TF32 setting.
    half = peak_flops(name, torch.bfloat16)
    assert peak_flops(name, torch.bfloat16, tf32=False) == half
    for value in (tf32, fp32):
        assert value is None or value < half


def test_every_table_entry_orders_its_peaks() -> None:
    for key, peak in device._PEAKS.items():
        # L40: its TF32 tensor-core and CUDA-core FP32 peaks are both 90.5 TFLOPS dense.
        assert peak.tf32 is None or peak.fp32 is None or peak.fp32 <= peak.tf32 < peak.half, key


def test_mfu_peak_flops_picks_the_precision_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert device.mfu_peak_flops("cuda", "bfloat16", tf32=True) == pytest.approx(989.4e12)
    assert device.mfu_peak_flops("cuda", "bfloat16", tf32=False) == pytest.approx(989.4e12)
    assert device.mfu_peak_flops("cuda", "float32", tf32=True) == pytest.approx(494.7e12)
    assert device.mfu_peak_flops("cuda", "float32", tf32=False) == pytest.approx(67e12)
    assert device.mfu_peak_flops("cpu", "float32", tf32=False) is None


def _precision_flags() -> tuple:
    b = torch.backends
    return (torch.get_float32_matmul_precision(), b.cuda.matmul.allow_tf32, b.cuda.matmul.fp32_precision,
            b.cudnn.allow_tf32)


def test_set_tf32_is_a_no_op_on_cpu() -> None:
    before = _precision_flags() + (torch.backends.mkldnn.matmul.fp32_precision,)
    for enabled in (True, False):
        assert device.set_tf32(enabled, "cpu") is False
    assert _precision_flags() + (torch.backends.mkldnn.matmul.fp32_precision,) == before


def test_set_tf32_cuda_flags() -> None:
    # The CUDA branch only sets process-wide torch.backends flags, which CPU builds have too.
    if torch.version.hip is not None:
        pytest.skip("ROCm leaves the flags alone")
    saved_precision, saved_cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        assert device.set_tf32(True, "cuda") is True
        # Every getter stays readable (no "mix of legacy and new APIs" error) and agrees; inductor reads these.
        assert _precision_flags() == ("high", True, "tf32", True)
        assert device.set_tf32(False, "cuda") is False
        assert _precision_flags() == ("highest", False, "ieee", False)
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        torch.backends.cudnn.allow_tf32 = saved_cudnn
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == (saved_precision, saved_cudnn)


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA GeForce RTX 4090",
        "NVIDIA A10G",  # deliberately unlisted: no trustworthy datasheet value
        "NVIDIA H100",  # form factor unknown, so SXM vs PCIe cannot be told apart
        "Intel(R) Xeon(R) Platinum 8480+",
        "",
    ],
)
def test_peak_flops_unknown_is_none(name: str) -> None:
    assert peak_flops(name, torch.bfloat16) is None
    assert peak_flops(name, torch.float32) is None
    assert peak_flops(name, torch.float32, tf32=False) is None


def test_peak_flops_unsupported_dtype_is_none() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_device_helpers_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only expectations")
    assert device.device_type() == "cpu"
    assert device.distributed_backend() == "gloo"
    name = device.device_name()
    assert isinstance(name, str) and name
    # A CPU never gets a peak, so MFU is never reported on CPU.
    assert peak_flops(name, torch.bfloat16) is None


# --------------------------------------------------------------------------- memory


def test_memory_monitor_cpu_rss_grows() -> None:
    mon = MemoryMonitor("cpu")
    assert mon.capacity_gib() > 0
    before = mon.snapshot()
    assert set(before) == {"rss_gib", "max_rss_gib"}
    assert before["rss_gib"] > 0
    assert before["max_rss_gib"] >= before["rss_gib"]

    # 256 MiB of written (hence resident) memory.
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    after = mon.snapshot()
    assert after["rss_gib"] - before["rss_gib"] > 0.2
    assert after["max_rss_gib"] >= after["rss_gib"]
    del big
    mon.reset_peak()  # must not raise even where clear_refs is not writable
    assert mon.snapshot()["max_rss_gib"] > 0


# --------------------------------------------------------------------------- metrics logger


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _make(tmp_path: Path, **kw) -> MetricsLogger:
    args = {
        "dump_folder": tmp_path / "run",
        "rank": 0,
        "total_steps": 100,
        "enable_tensorboard": False,
        "save_tb_folder": "tb",
        "enable_wandb": False,
    }
    args.update(kw)
    return MetricsLogger(**args)


def _step_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in (r.getMessage() for r in caplog.records) if m.startswith("step")]


@pytest.fixture
def capture(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    # init_logger() may have set propagate=False elsewhere; caplog listens on the root.
    monkeypatch.setattr(tt_logger, "propagate", True)
    caplog.set_level(logging.INFO, logger="torchtitan")
    return caplog


def test_jsonl_lines_and_keys(tmp_path: Path) -> None:
    ml = _make(tmp_path)
    ml.log(
        1,
        {"loss": 5.5, "lr": 1e-4, "mfu": None, "max_reserved_gib": 3.0, "num_ooms": 0},
    )
    ml.log(2, {"loss": torch.tensor(5.25), "grad_norm": 1.5, "mem/rss_gib": 1.0})
    rows = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
    ml.close()

    assert rows[0] == {
        "step": 1,
        "loss": 5.5,
        "lr": 1e-4,
        "mfu": None,  # kept as null
        "mem/max_reserved_gib": 3.0,
        "mem/num_ooms": 0,
    }
    assert rows[1] == {"step": 2, "loss": 5.25, "grad_norm": 1.5, "mem/rss_gib": 1.0}


def test_jsonl_flushed_before_close(tmp_path: Path) -> None:
    ml = _make(tmp_path)
    ml.log(1, {"loss": 1.0})
    # Read while the logger is still open: a crash right now must not lose the line.
    assert _read_jsonl(tmp_path / "run" / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]
    ml.close()
    ml.close()  # idempotent


def test_memory_snapshot_round_trip(tmp_path: Path) -> None:
    snap = MemoryMonitor("cpu").snapshot()
    with _make(tmp_path) as ml:
        ml.log(1, {"loss": 1.0, **snap})
    row = _read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert set(row) == {"step", "loss", "mem/rss_gib", "mem/max_rss_gib"}


def test_tensorboard_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ml = _make(tmp_path, enable_tensorboard=True, save_tb_folder="tb")
    ml.log(1, {"loss": 4.0, "mfu": None, "max_reserved_gib": 2.0})
    ml.log(2, {"loss": 3.0, "mfu": None, "max_reserved_gib": 2.5})
    ml.close()

    tb_dir = tmp_path / "run" / "tb"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "loss" in tags and "mem/max_reserved_gib" in tags
    assert "mfu" not in tags  # None is skipped
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 4.0), (2, 3.0)]


def test_tensorboard_histograms_and_moe_console_fields(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Tokens per expert go to TensorBoard as histograms; the MoE load and balance loss reach the console line."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ml = _make(tmp_path, enable_tensorboard=True, save_tb_folder="tb")
    with caplog.at_level("INFO"):
        ml.log(1, {"loss": 4.0, "moe_load_max_over_mean": 1.53, "moe_aux_loss": 0.0123, "moe_load/layers.0.moe": 1.5})
    ml.log_histograms(1, {"moe_tokens_per_expert/layers.0.moe": torch.tensor([3.0, 0.0, 5.0, 8.0])})
    ml.close()
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert "moe_tokens_per_expert/layers.0.moe" in acc.Tags()["histograms"]
    assert "moe_load/layers.0.moe" in acc.Tags()["scalars"]
    [line] = _step_lines(caplog)
    assert "moe load 1.53" in line and "moe aux 0.0123" in line, line


def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "torchtitan-test")
    # Keep W&B's side files (cache, settings, and the wandb-core debug logs that it
    # writes under the cache dir) in the tmp dir instead of the home directory.
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))

    ml = _make(tmp_path, enable_wandb=True, run_config={"model": "debug", "lr": 3e-4})
    ml.log(1, {"loss": 2.0, "mfu": None})
    ml.close()
    ml.close()

    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))


def test_nonzero_rank_writes_nothing(tmp_path: Path, capture) -> None:
    ml = _make(tmp_path, rank=1, enable_tensorboard=True)
    ml.log(1, {"loss": 1.0})
    ml.close()
    assert not (tmp_path / "run").exists()
    assert not capture.records


def test_save_for_all_ranks(tmp_path: Path, capture) -> None:
    for rank in (0, 1):
        ml = _make(tmp_path, rank=rank, save_for_all_ranks=True, enable_tensorboard=True)
        ml.log(1, {"loss": 1.0 + rank})
        ml.close()
    for rank in (0, 1):
        rank_dir = tmp_path / "run" / f"rank_{rank}"
        assert _read_jsonl(rank_dir / "metrics.jsonl") == [{"step": 1, "loss": 1.0 + rank}]
        assert list((rank_dir / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # Console stays rank 0 only.
    assert len(_step_lines(capture)) == 1


def test_console_line(tmp_path: Path, capture, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([1000.0, 1000.0 + 39 * 0.5])
    monkeypatch.setattr(metrics_mod, "_now", lambda: next(clock))
    ml = _make(tmp_path, started_at=1000.0 - 72)  # the trainer started 72 s before step 1 was logged
    ml.log(1, {"loss": 6.0})
    ml.log(
        40,
        {
            "loss": 5.12344,
            "loss_max": 5.2,
            "grad_norm": 1.234,
            "lr": 3e-4,
            "tps": 12345.4,
            "tflops": 45.12,
            "mfu": 40.23,
            "max_reserved_gib": 12.34,
            "max_reserved_pct": 15.4,
            "max_active_gib": 10.0,
            "num_alloc_retries": 0,
            "data_wait_pct": 1.23,
            "tokens_seen": 4_915_200,
        },
    )
    ml.close()
    lines = _step_lines(capture)
    assert lines[0] == "step   1/100  loss 6.0000  elapsed 0:01:12"  # no time per step or ETA without a previous step
    # 0.5 s/step over the last interval, 60 steps left -> 30 s.
    assert lines[1] == (
        "step  40/100  loss 5.1234 (max 5.2000)  gnorm 1.23  lr 3.0e-04  tps 12,345"
        "  tflops 45.1  mfu 40.2%  mem 12.3GiB(15%)  data 1.2%  tokens 4.92M  0.5s/step  elapsed 0:01:32  eta 0:00:30"
    )


def test_console_line_skips_missing_and_uses_cpu_memory(tmp_path: Path, capture) -> None:
    ml = _make(tmp_path, total_steps=5)
    ml.log(
        3,
        {
            "loss": None,
            "mfu": None,
            "tps": 10.0,
            "rss_gib": 1.31,
            "max_rss_gib": 2.0,
            "num_ooms": 2,
            "tflops": 0.0342,  # a CPU run: three significant digits, not 0.0
        },
    )
    ml.close()
    (line,) = _step_lines(capture)
    assert line.startswith("step 3/5  tps 10  tflops 0.0342  mem 1.3GiB ooms 2  elapsed 0:00:0"), line


# The allocator and FPU settings under test are process-wide: each case runs in a child of the test fork server
# (tests/unit/forked.py in_child), which starts with the defaults (the fork server only imports modules) without a
# new interpreter importing torch. The "before" values check those defaults.


def _freed_memory_kept_mib() -> tuple[bool, float, float, float]:
    from torchtitan.tools.device import _current_rss_bytes, keep_freed_host_memory, release_freed_host_memory

    def kept_after_free() -> float:
        base = _current_rss_bytes()
        t = torch.ones(64 << 20)  # 256 MiB, touched
        del t
        return (_current_rss_bytes() - base) / 2**20

    before = kept_after_free()
    ok = keep_freed_host_memory()
    after = kept_after_free()
    base = _current_rss_bytes()
    release_freed_host_memory()
    return ok, before, after, (base - _current_rss_bytes()) / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_host_memory_keeps_large_tensors_mapped() -> None:
    # Without it a freed 256 MiB tensor is unmapped at once (RSS drops back); with it the memory stays for reuse
    # until release_freed_host_memory.
    from tests.unit.forked import in_child

    ok, before, after, released = out = in_child(_freed_memory_kept_mib)
    assert ok is True and before < 64 and after > 200, out
    assert released > 200, out  # malloc_trim hands the kept memory back


def _denormals_flushed() -> tuple[bool, bool, bool]:
    from torchtitan.tools.device import flush_cpu_denormals

    x = torch.tensor([1e-39], dtype=torch.float32)
    before = (x * 1.0).item()
    return flush_cpu_denormals(), before > 0, (x * 1.0).item() == 0.0


def test_flush_cpu_denormals_zeroes_subnormals() -> None:
    from tests.unit.forked import in_child

    out = in_child(_denormals_flushed)
    assert out in ((True, True, True), (False, True, False)), out  # False: a CPU without FTZ/DAZ


def test_fresh_run_moves_an_earlier_runs_file_aside_and_a_resumed_run_appends(tmp_path: Path, capture):
    caplog = capture
    with _make(tmp_path) as ml:
        ml.log(1, {"loss": 3.0})
        ml.log(2, {"loss": 2.0})
    with _make(tmp_path, resumed_after=2) as ml:  # resumed from step 2's checkpoint: the same run goes on
        ml.log(3, {"loss": 1.5})
    run = tmp_path / "run"
    assert [r["step"] for r in _read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert any("appending to" in r.getMessage() for r in caplog.records)
    for _ in range(2):  # two fresh runs within the same second keep both earlier files
        with _make(tmp_path) as ml:
            ml.log(1, {"loss": 9.0})
    assert _read_jsonl(run / "metrics.jsonl") == [{"step": 1, "loss": 9.0}]
    earlier = sorted(p.name for p in run.glob("metrics.*.jsonl"))
    assert len(earlier) == 2, earlier
    assert sorted(len(_read_jsonl(run / name)) for name in earlier) == [1, 3]
    assert any("moved it to" in r.getMessage() for r in caplog.records)
