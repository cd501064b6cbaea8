"""Device helpers: which accelerator we run on, its fp32 matmul precision (TF32), its peak FLOPS, its memory use.

The peak-FLOPS table feeds the MFU metric. A wrong peak silently produces a wrong
MFU, which is worse than none, so unknown or ambiguous devices yield ``None`` and
the trainer then simply does not report MFU.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import resource
import sys
from dataclasses import dataclass

import torch

from torchtitan.tools.logging import logger

_GIB = float(1 << 30)


def device_type() -> str:
    """Return "cuda" when a CUDA (or ROCm, which also reports as cuda) GPU is usable, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def training_param_dtype(requested: str, device_type: str) -> str:
    """The parameter dtype training actually uses: fp32 on CPU whatever the config asks (bf16 there is for GPUs)."""
    return "float32" if device_type == "cpu" else requested


def distributed_backend() -> str:
    """NCCL (RCCL on ROCm) for GPUs; gloo is the only portable choice on CPU."""
    return "nccl" if device_type() == "cuda" else "gloo"


def _cpu_model() -> str:
    # /proc/cpuinfo has the marketing name on x86; platform.processor() is often
    # empty on Linux, so it is only a fallback.
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("model name", "hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name() -> str:
    """Human-readable name of the current device; for GPUs it is also the peak_flops() key."""
    if device_type() == "cuda":
        return torch.cuda.get_device_name()
    return _cpu_model()


# --------------------------------------------------------------------------- peak FLOPS


@dataclass(frozen=True)
class _Peak:
    # Dense (no 2:4 sparsity) peaks in FLOP/s, as vendor datasheets give them. None = no trustworthy figure
    # (or no such path), so MFU is not reported for that precision.
    half: float  # bf16 / fp16 tensor/matrix cores
    tf32: float | None  # fp32 matmuls with training.tf32 on: TF32 tensor cores (NVIDIA)
    fp32: float | None  # fp32 matmuls at full precision: CUDA cores on NVIDIA, FP32 matrix cores on AMD


# Datasheets quote sparse tensor-core numbers for NVIDIA parts; the dense value is half of that. The plain
# FP32 column is the datasheet's "FP32" (CUDA-core) line, which has no sparse variant.
# MI250X: ROCm exposes each of the two dies (GCDs) of a module as its own device, and
# MFU is computed per device, so the per-GCD half of the 383 / 95.7 TFLOPS module peak
# is used. Deliberately absent for lack of a trustworthy number: A10G (AWS-specific
# variant whose tensor peak NVIDIA does not publish), plain "H100" with no form factor.
_PEAKS: dict[str, _Peak] = {
    # H100 datasheet: FP32 67 (SXM) / 51 (PCIe) TFLOPS.
    "H100 SXM": _Peak(989.4e12, 494.7e12, 67e12),
    "H100 PCIe": _Peak(756.5e12, 378.0e12, 51e12),
    # NVL (PCIe card, NVLink bridge): datasheet 1,671 bf16 / 835 tf32 TFLOPS with
    # sparsity, FP32 60 TFLOPS. Less certain than the SXM/PCIe values: not cross-checked with a
    # second source here; same figures assumed for the H200 NVL.
    "H100 NVL": _Peak(835.5e12, 417.5e12, 60e12),
    # H200 and GH200 use the same GH100 compute as the H100 SXM; only memory differs.
    # H200 and GH200 datasheets: FP32 67 TFLOPS (H200 NVL: 60).
    "H200": _Peak(989.4e12, 494.7e12, 67e12),
    "H200 NVL": _Peak(835.5e12, 417.5e12, 60e12),
    "GH200": _Peak(989.4e12, 494.7e12, 67e12),
    # A100 datasheet: FP32 19.5 TFLOPS (same for the 40 and 80 GB, SXM and PCIe parts).
    "A100": _Peak(312e12, 156e12, 19.5e12),
    # L40S / L40 / L4 datasheets: FP32 91.6 / 90.5 / 30.3 TFLOPS (the L40's dense TF32 is also 90.5).
    "L40S": _Peak(362.05e12, 183e12, 91.6e12),
    "L40": _Peak(181.05e12, 90.5e12, 90.5e12),
    "L4": _Peak(121e12, 60e12, 30.3e12),
    # HGX B200 (1000 W): 4.5 PF bf16 / 2.2 PF tf32 with sparsity; the datasheet's
    # tf32 is slightly under half of bf16, and the datasheet is what we follow.
    # Plain FP32 left out: no per-GPU figure checked against a datasheet here.
    "B200": _Peak(2.25e15, 1.1e15, None),
    # GB200 GPU (up to 1200 W): 5 PF bf16 / 2.5 PF tf32 sparse; plain FP32 left out as for B200.
    "GB200": _Peak(2.5e15, 1.25e15, None),
    # CDNA3 has no sparsity in these figures; fp32 is the "FP32 matrix" peak. No TF32 figure:
    # training.tf32 leaves ROCm at full fp32 (set_tf32), so fp32 runs there use the fp32 column.
    "MI300X": _Peak(1307.4e12, None, 163.4e12),
    "MI325X": _Peak(1307.4e12, None, 163.4e12),
    "MI250X": _Peak(191.5e12, None, 47.85e12),
}


def _tokens(name: str) -> set[str]:
    # Whole-token matching sidesteps substring traps: "GH200" contains "H200",
    # "A100" contains "A10", "L40S" contains "L4".
    return {t for t in re.split(r"[^A-Z0-9]+", name.upper()) if t}


def _table_key(name: str) -> str | None:
    tok = _tokens(name)
    if "H100" in tok:
        if "NVL" in tok:
            return "H100 NVL"
        if "PCIE" in tok:
            return "H100 PCIe"
        # The SXM part reports itself as e.g. "NVIDIA H100 80GB HBM3"; some
        # drivers spell out "H100-SXM5". PCIe cards never mention HBM.
        if any(t.startswith(("HBM", "SXM")) for t in tok):
            return "H100 SXM"
        return None
    if "H200" in tok:
        return "H200 NVL" if "NVL" in tok else "H200"
    for key in (
        "GH200",
        "GB200",
        "B200",
        "A100",
        "L40S",
        "L40",
        "L4",
        "MI300X",
        "MI325X",
        "MI250X",
    ):
        if key in tok:
            return key
    return None


def peak_flops(name: str, dtype: torch.dtype, *, tf32: bool = True) -> float | None:
    """Dense peak matmul FLOP/s of one device for ``dtype``, or None when unknown.

    bf16/fp16 give the tensor-core peak. fp32 gives the TF32 tensor-core peak when ``tf32`` (TF32 is on, see
    set_tf32), else the full-precision fp32 peak. Anything else, an unlisted device, a precision without a
    trustworthy figure, or a CPU gives None so MFU is not reported rather than guessed.
    """
    key = _table_key(name)
    if key is None:
        return None
    peak = _PEAKS[key]
    if dtype in (torch.bfloat16, torch.float16):
        return peak.half
    if dtype == torch.float32:
        return peak.tf32 if tf32 else peak.fp32
    return None


def mfu_peak_flops(device_type: str, param_dtype: str, *, tf32: bool) -> float | None:
    """The peak MFU is computed against for this run: the precision its matmuls actually use, on this device.

    ``param_dtype`` is training_param_dtype()'s answer ("bfloat16" | "float32"); ``tf32`` is what set_tf32()
    returned. None on CPU and on devices or precisions without a datasheet figure.
    """
    if device_type != "cuda":
        return None
    dtype = torch.float32 if param_dtype == "float32" else torch.bfloat16
    return peak_flops(device_name(), dtype, tf32=tf32)


# --------------------------------------------------------------------------- TF32


def set_tf32(enabled: bool, device_type: str) -> bool:
    """Apply training.tf32 once at setup; return whether fp32 matmuls now use TF32 (the MFU peak depends on it).

    NVIDIA GPUs only. CPU (where "high" matmul precision would switch oneDNN's fp32 matmuls too) and ROCm are
    left at torch's defaults, which are full fp32 precision for matmuls, and False is returned.
    """
    if device_type != "cuda" or torch.version.hip is not None:
        return False
    # Both settings exist unchanged in torch 2.11 and 2.13 and neither warns there. torch's newer per-backend
    # `fp32_precision` attributes are avoided on purpose: measured on torch 2.13 (2.11 ships the same checks),
    # setting e.g. torch.backends.cuda.matmul.fp32_precision alone makes getters that inductor still calls
    # (torch.get_float32_matmul_precision, torch.backends.cudnn.allow_tf32) raise a "mix of the legacy and new
    # APIs" RuntimeError, while these two setters keep every getter readable and consistent.
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    return enabled


def flush_cpu_denormals() -> bool:
    """Treat subnormal fp32/bf16 values on the CPU as zero (x86 FTZ/DAZ; torch.set_flush_denormal); returns
    whether this CPU supports it.

    Measured (torch 2.13, one thread): on logits spread as a confident model's are (std 30), the softmax
    probabilities of unlikely tokens fall below 1.2e-38 and cross-entropy forward + backward over 4096 x 8192
    logits takes 506 ms instead of 200 ms. Values that small carry nothing a gradient update can use (bf16
    and GPU tensor cores flush them too). It applies to the calling thread, which runs forward, backward (CPU
    autograd runs on the caller) and the optimizer; with more intra-op threads the others keep the default.
    """
    return torch.set_flush_denormal(True)


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc behave like a caching allocator for CPU tensors; returns whether it could.

    By default glibc serves every allocation over 32 MiB with a fresh mmap and unmaps it on free, so each step
    page-faults its large activations (the logits and their gradients) in again: measured (torch 2.13, one
    thread), allocating, filling and freeing two 128 MiB tensors took 118 ms, 38 ms with mmap off and the heap
    kept (M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB), and the trainer's step at docs/performance.md's workload went
    from 2,342 to 2,659 tokens/s. Freed memory stays in the process for the next step, as CUDA's caching
    allocator keeps device memory. The cost is fragmentation: the heap keeps holes that a slightly larger
    request cannot use, so peak RSS rose from 1.26 to 1.38 GiB there and creeps while the allocation pattern
    changes (validation); release_freed_host_memory, every training.gc_freq steps, hands the holes back.
    Linux/glibc only (elsewhere nothing changes).
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4  # glibc's malloc.h
    return bool(mallopt(m_mmap_max, 0) and mallopt(m_trim_threshold, 2**31 - 1) and mallopt(m_top_pad, 64 << 20))


def release_freed_host_memory() -> None:
    """Return the free parts of the heap to the OS (glibc malloc_trim), bounding what keep_freed_host_memory
    keeps; the next step faults its large tensors in once more."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _libc():
    """The C library already loaded into this process, on Linux; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


# --------------------------------------------------------------------------- memory


def _read_status_kib(field: str) -> float | None:
    # /proc/self/status gives VmRSS / VmHWM in kB; absent outside Linux.
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except (OSError, IndexError, ValueError):
        pass
    return None


def _ru_maxrss_bytes() -> float:
    # ru_maxrss is KiB on Linux but bytes on macOS.
    raw = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return raw if sys.platform == "darwin" else raw * 1024.0


def _current_rss_bytes() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return float(resident_pages * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, IndexError, ValueError):
        pass
    try:  # optional; not a dependency of the package
        import psutil  # type: ignore[import-not-found]

        return float(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    # Last resort: the high-water mark is an upper bound on current RSS.
    return _ru_maxrss_bytes()


def host_memory_bytes() -> float:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


class MemoryMonitor:
    """Peak memory since the last reset_peak(), for the per-step metrics line.

    On CUDA it reads the caching allocator's counters; "active" is what tensors use,
    "reserved" is what the allocator holds from the driver (the number that OOMs).
    On CPU it reports the process RSS and its high-water mark.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = "cuda" if device_type == "cuda" else "cpu"
        if self.device_type == "cuda":
            self._device = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(self._device)
            self._capacity_bytes = float(props.total_memory)
            logger.info("GPU %s: %.2f GiB total memory", props.name, self._capacity_bytes / _GIB)
        else:
            self._device = None
            self._capacity_bytes = host_memory_bytes()
        self.reset_peak()

    def capacity_gib(self) -> float:
        """Total device memory (host RAM on CPU) in GiB."""
        return self._capacity_bytes / _GIB

    def reset_peak(self) -> None:
        """Start a new peak-measurement window (typically once per logged step)."""
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
            return
        # Writing "5" to clear_refs resets this process's VmHWM (Linux >= 4.0). If that
        # is not permitted, peaks stay process-lifetime, which is still correct as an
        # upper bound.
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
        except OSError:
            pass

    def snapshot(self) -> dict[str, float]:
        """Current memory figures; keys differ between cuda and cpu (see module docs)."""
        if self.device_type == "cuda":
            return self._cuda_snapshot()
        return self._cpu_snapshot()

    def _pct(self, nbytes: float) -> float:
        return 100.0 * nbytes / self._capacity_bytes if self._capacity_bytes > 0 else 0.0

    def _cuda_snapshot(self) -> dict[str, float]:
        stats = torch.cuda.memory_stats(self._device)
        active = float(stats.get("active_bytes.all.peak", 0))
        reserved = float(stats.get("reserved_bytes.all.peak", 0))
        # Retries mean the allocator had to free its cache and try again: a sign of
        # fragmentation that costs throughput long before an actual OOM.
        return {
            "max_active_gib": active / _GIB,
            "max_active_pct": self._pct(active),
            "max_reserved_gib": reserved / _GIB,
            "max_reserved_pct": self._pct(reserved),
            "num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "num_ooms": float(stats.get("num_ooms", 0)),
        }

    def _cpu_snapshot(self) -> dict[str, float]:
        rss = _current_rss_bytes()
        hwm_kib = _read_status_kib("VmHWM")
        peak = hwm_kib * 1024.0 if hwm_kib is not None else _ru_maxrss_bytes()
        # RSS can be sampled after the kernel's counter was reset, so keep them consistent.
        peak = max(peak, rss)
        return {"rss_gib": rss / _GIB, "max_rss_gib": peak / _GIB}
