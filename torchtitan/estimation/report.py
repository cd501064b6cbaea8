"""Device capacities, the analytic cross-check and the printed / JSON report of an estimate."""

from __future__ import annotations

from torchtitan.components.model_parts import loss_chunks
from torchtitan.config.flavor import flavor_args
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.estimation.engine import CATEGORIES, Estimate

GIB = 1024**3


# On a GPU the caching allocator reserves more than the tensors' peak (block rounding, fragmentation between
# segments). Measured on one H200 (torch 2.11, the 8B block shape with 8 blocks, seq 8192, default allocator
# settings): reserved 12.7% above the peak active at local batch 1 (57.44 / 50.98 GiB) and 16.1% at local batch 2
# (80.89 / 69.66 GiB). The verdict adds the larger share on GPU targets until the launcher's default allocator
# settings (expandable segments, torchtitan/launch.py) are measured: scripts/gpu_check.py reports both.
GPU_ALLOCATOR_OVERHEAD = 0.161


def needed_gib(peak_bytes: int, reserve_gib: float) -> float:
    """Device memory a job needs: the tensors' peak, on a GPU target (a reserve above 0) grown by the allocator's
    overhead, plus the reserve (CUDA context, NCCL, kernels). With reserve 0 (CPU, or --reserve-gib 0) the peak."""
    overhead = GPU_ALLOCATOR_OVERHEAD if reserve_gib > 0 else 0.0
    return peak_bytes / GIB * (1 + overhead) + reserve_gib


def fits(peak_bytes: int, capacity_gib: float, reserve_gib: float) -> bool:
    """The verdict of every report (render, as_json, dry_run.verdict, the advice, the trainer's estimate): what the
    job needs (needed_gib) within the capacity."""
    return needed_gib(peak_bytes, reserve_gib) <= capacity_gib

# Usable memory as torch.cuda.get_device_properties(...).total_memory reports it (a bit below the marketing
# figure), in GiB. Override with --memory-gib for anything else.
DEVICE_MEMORY_GIB = {
    "h100": 79.1,
    "h100-pcie": 79.1,
    "h100-nvl": 93.1,
    "h200": 139.8,
    "a100-80gb": 79.2,
    "a100-40gb": 39.4,
    "b200": 178.4,
    "mi300x": 192.0,
    "l40s": 44.4,
}

# On a GPU, memory outside the tensors the trainer allocates: CUDA context and kernels, NCCL buffers, and the
# caching allocator's rounding and fragmentation. Not modelled by the fake run; a fixed reserve until measured.
DEFAULT_GPU_RESERVE_GIB = 3.0


def add_target_arguments(parser) -> None:
    """The target-device options the estimator script and the dry run share (argparse)."""
    parser.add_argument("--device", default="h100", help="target device from the table (report.py), or cpu")
    parser.add_argument("--memory-gib", type=float, default=None, help="device memory, overriding the table")
    parser.add_argument("--reserve-gib", type=float, default=None,
                        help=f"memory outside tensors (default {DEFAULT_GPU_RESERVE_GIB} on GPUs, 0 on cpu)")


def device_capacity_gib(device: str, memory_gib: float | None) -> float:
    if memory_gib is not None:
        if memory_gib <= 0:
            raise ValueError(f"--memory-gib must be > 0, got {memory_gib}")
        return memory_gib
    key = device.lower()
    if key not in DEVICE_MEMORY_GIB:
        raise ValueError(f"unknown device '{device}'; known: {', '.join(DEVICE_MEMORY_GIB)} "
                         "(or give --memory-gib)")
    return DEVICE_MEMORY_GIB[key]


def analytic(cfg: JobConfig, parallel_dims: ParallelDims, est: Estimate, param_bytes: int) -> dict[str, float]:
    """Closed-form numbers to hold the tracked ones against (GiB).

    States: 4 bytes per local parameter element (fp32 sharded master weights), the same for the gradient
    (fp32 reduce) and 8 for AdamW's two moments, these two for trainable parameters only (LoRA freezes the rest).
    Activations without checkpointing: per token and layer about
    11 x dim + 3 x kv_dim + 4 x ffn_hidden elements saved for backward (norm inputs/outputs, q/k/v before and
    after rotary, attention output, the four SwiGLU tensors), with per-op AC 4 x dim + 2 x kv_dim + 2 x
    ffn_hidden (matmul and attention outputs), divided by TP; checkpointed blocks keep their input; plus the
    logits and their fp32 log-softmax (2 x vocab per token, divided by TP with loss parallel, and by the loss
    chunks: chunked logits exist one chunk at a time).
    """
    args = flavor_args(cfg)
    tp = parallel_dims.tp
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    kv = args.num_kv_heads * args.head_dim
    per_layer = 11 * args.dim + 3 * kv + 4 * args.ffn_hidden_dim
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        # only matmul and attention outputs are kept: q, k, v, attention out, wo, w1, w3, w2
        per_layer = 4 * args.dim + 2 * kv + 2 * args.ffn_hidden_dim
    layers_kept = args.n_layers
    if ac.mode == "full":
        layers_kept = 0
    elif ac.mode == "selective" and ac.selective_ac_option.isdigit():
        layers_kept = args.n_layers - len(range(0, args.n_layers, int(ac.selective_ac_option)))
    block_io = args.dim * args.n_layers  # checkpointed blocks keep only their input
    logits = 2 * args.vocab_size / (tp if parallel_dims.loss_parallel_enabled(cfg.parallelism.disable_loss_parallel)
                                    else 1) / loss_chunks(cfg, parallel_dims, None, args.vocab_size)
    act_elems = tokens * (per_layer * layers_kept / tp + block_io / tp + logits)
    n = est.counts["parameters"]
    trainable = est.counts.get("trainable_parameters", n)  # frozen parameters (LoRA's base) have neither
    return {
        "parameters": 4 * n / GIB,
        "gradients": 4 * trainable / GIB,
        "optimizer_state": 8 * trainable / GIB,
        "activations": act_elems * param_bytes / GIB,
    }


def depth_note(extrapolated_from: tuple[int, int] | None, full_depth_reason: str = "") -> str:
    """How deep the trace was: two shallower traces extrapolated (blocks of the model, or under pipeline parallel
    of this rank's stages), or every block, with the reason when a pipeline rank could not be extrapolated."""
    how = f"extrapolated in depth from traces of {extrapolated_from[0]} and {extrapolated_from[1]} blocks" \
        if extrapolated_from else "every block traced"
    return f"{how} ({full_depth_reason})" if full_depth_reason else how


def render(est: Estimate, analytic_gib: dict[str, float], capacity_gib: float, reserve_gib: float,
           device: str, layout: str) -> str:
    peak = est.peak_bytes / GIB
    lines = [
        f"memory estimate: rank {est.rank} of {est.world_size} ({layout}), estimated in {est.seconds:.1f} s "
        f"({depth_note(est.extrapolated_from, est.full_depth_reason)})",
        f"  peak tensor memory {peak:8.2f} GiB  during {est.peak_phase}",
        "  alive at the peak:",
    ]
    for name in CATEGORIES:
        gib = est.breakdown[name] / GIB
        lines.append(f"    {name:17s} {gib:8.2f} GiB  {100 * gib / max(peak, 1e-12):5.1f}%")
    lines.append("  analytic cross-check (closed form, GiB):      tracked  analytic")
    for name in ("parameters", "gradients", "optimizer_state"):
        tracked = est.steady_bytes[name] / GIB
        lines.append(f"    {name:17s} between steps       {tracked:8.2f}  {analytic_gib[name]:8.2f}")
    lines.append(f"    {'activations':17s} at the peak         {est.breakdown['activations'] / GIB:8.2f}  "
                 f"{analytic_gib['activations']:8.2f}  (approximate formula)")
    need = needed_gib(est.peak_bytes, reserve_gib)
    verdict = "FITS" if fits(est.peak_bytes, capacity_gib, reserve_gib) else "DOES NOT FIT"
    grown = f" x {1 + GPU_ALLOCATOR_OVERHEAD:.3f} (allocator)" if reserve_gib > 0 else ""
    lines.append(f"  device {device}: {capacity_gib:.1f} GiB; needed {peak:.2f}{grown} + {reserve_gib:.1f} reserve "
                 f"(CUDA context, NCCL) = {need:.2f} GiB")
    lines.append(f"  verdict: {verdict}, headroom {capacity_gib - need:+.2f} GiB")
    return "\n".join(lines)


def as_json(est: Estimate, analytic_gib: dict[str, float], capacity_gib: float, reserve_gib: float,
            device: str, layout: str) -> dict:
    need = needed_gib(est.peak_bytes, reserve_gib)
    return {
        "rank": est.rank, "world_size": est.world_size, "layout": layout, "device": device,
        "capacity_gib": capacity_gib, "reserve_gib": reserve_gib,
        "peak_bytes": est.peak_bytes, "peak_gib": est.peak_bytes / GIB, "peak_phase": est.peak_phase,
        "breakdown_bytes": est.breakdown, "steady_bytes": est.steady_bytes,
        "analytic_gib": analytic_gib, "needed_gib": need, "fits": fits(est.peak_bytes, capacity_gib, reserve_gib),
        "headroom_gib": capacity_gib - need, "seconds": est.seconds,
        "extrapolated_from": est.extrapolated_from, "full_depth_reason": est.full_depth_reason,
    }
