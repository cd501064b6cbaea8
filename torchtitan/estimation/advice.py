"""Exit codes of the memory estimator and the dry run, and the advice they print when a job does not fit.

Exit codes, for submit scripts: 0 the job fits, 3 it does not fit, 2 bad input (a config error naming its key, a bad
argument), 1 the estimate itself failed (a traceback: a bug to report).

Advice: the smallest change along each of a few dimensions that makes the job fit, in the order of what it is expected
to cost in throughput: activation checkpointing (none -> selective per-op -> full), sharding over more data-parallel
ranks (HSDP replicas folded into FSDP, then more nodes), tensor parallel within a node, pipeline parallel, a smaller
local batch with more gradient accumulation (the global batch stays), and last a shorter sequence (that changes the
job). Every suggestion is estimated again by the caller's own estimate function (the same engine, every pipeline
rank: the worst stage decides), after the trainer's config checks (`load_config`); a change those checks refuse is
listed as invalid, never suggested. The search is bounded: each dimension stops at its first change that fits, and at
most `max_estimates` changes are estimated. A change that cannot fit even in the best case (see `_changes`) is skipped
without estimating it; that bound only saves estimates, it never makes a suggestion.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import load_config, read_args
from torchtitan.estimation.dry_run import representative_ranks
from torchtitan.estimation.report import GIB, fits, needed_gib

EXIT_FITS, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 1, 2, 3
EXIT_CODES = ("exit codes: 0 the job fits, 3 it does not fit (with advice unless --no-advice), 2 bad input (config "
              "error or bad argument), 1 the estimate itself failed (traceback)")
DEFAULT_MAX_ESTIMATES = 6
# The best cases below are lower bounds of the peak (see _changes); a change within this fraction of fitting is
# estimated all the same, so that a rounding the bounds do not see cannot hide a change that fits.
_BOUND_SLACK = 0.02
_STATES = ("parameters", "gradients", "optimizer_state")


def exit_code(fit: bool) -> int:
    return EXIT_FITS if fit else EXIT_DOES_NOT_FIT


def add_advice_arguments(parser) -> None:
    """The advice options the estimator script and the dry run share (argparse)."""
    parser.add_argument("--no-advice", action="store_true",
                        help="when the job does not fit, do not search for changes that fit (each costs an estimate)")
    parser.add_argument("--advice-estimates", type=int, default=DEFAULT_MAX_ESTIMATES,
                        help=f"most changes estimated when searching for advice (default {DEFAULT_MAX_ESTIMATES}; "
                             "under pipeline parallel each costs one estimate per pipeline rank)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (the wrappers pass NGPU; default 8, or the world size when 8 does not "
                             "divide it): tensor parallel stays within a node, more nodes add this many GPUs each")


def checked_gpus_per_node(world_size: int, given: int | None, max_estimates: int) -> int:
    """--gpus-per-node (default: 8-GPU nodes, or one node when they do not divide the world) and --advice-estimates,
    checked as bad input (exit code 2)."""
    if max_estimates < 1:
        raise ConfigError(f"--advice-estimates must be >= 1 (or give --no-advice), got {max_estimates}")
    if given is None:
        return 8 if world_size % 8 == 0 else world_size
    if given < 1 or world_size % given:
        raise ConfigError(f"--gpus-per-node {given} does not divide the world of {world_size} ranks")
    return given


@dataclass
class Change:
    dimension: str
    change: str
    """what changes, e.g. 'none -> full' or '1 -> 2'"""
    overrides: list[str]
    """config overrides appended to the job's (the last value of a key wins)"""
    cost: str
    """what it is expected to cost, in words"""
    bound_bytes: int
    """the lowest peak this change could give (only to skip hopeless changes without estimating them)"""
    world_size: int
    ngpu: int
    nnodes: int
    launch: str = ""
    """'NGPU=.. NNODES=..' when the change needs another number of GPUs"""
    status: str = "not estimated"
    """fits | does not fit | invalid (the config checks refuse it) | cannot fit (best case) | not estimated (budget)
    | failed (the estimate raised)"""
    reason: str = ""
    peak_bytes: int | None = None
    """the worst peak of the pipeline ranks estimated (all of them when it fits)"""
    worst_rank: int | None = None
    ranks_estimated: int = 0
    ranks_total: int = 0
    needed_gib: float | None = None
    headroom_gib: float | None = None

    @property
    def paste(self) -> str:
        return " ".join(filter(None, [self.launch, shlex.join(self.overrides)]))


def _changes(config_args: list[str], world_size: int, gpus_per_node: int, base: list) -> list[list[Change]]:
    """Per dimension, cheapest first, the changes to try, each smallest first."""
    written = read_args(config_args)  # as written: which keys were left to be derived (-1)
    cfg, resolved = load_config(config_args, world_size)
    pd, t, ac = resolved.parallel_dims, cfg.training, cfg.activation_checkpoint
    nodes = world_size // gpus_per_node
    peak = max(e.peak_bytes for e in base)
    # Best cases: lower bounds of the changed job's peak, from the base estimates. Activation checkpointing, the local
    # batch and the sequence length leave parameters, gradients and optimizer state as they are, and all three are
    # alive in the optimizer step: the peak cannot drop below them.
    states = max(sum(e.steady_bytes.values()) for e in base)

    def sharded(k: int) -> int:
        # More data-parallel shards (same local batch) shrink, at each phase's peak, the states alive then to 1/k (or a
        # little more, shards being rounded up) and nothing else: activations and gathered parameters stay. Only the
        # first micro-batch's phases count: keeping the global batch on more ranks may leave fewer micro-batches.
        return max((round(p.bytes - sum(p.breakdown[c] for c in _STATES) * (1 - 1 / k))
                    for e in base for p in e.step_peaks.values() if _first_micro_batch(p.phase)), default=0)

    # Keep the job's global batch where a change would derive another one (fewer data-parallel ranks: more
    # accumulation), and let the shard degree take the leftover ranks again if the job fixed it.
    keep_batch = [] if written.training.global_batch_size != -1 else \
        ["--training.global_batch_size", str(t.global_batch_size)]
    free_shard = [] if written.parallelism.data_parallel_shard_degree == -1 else \
        ["--parallelism.data_parallel_shard_degree", "-1"]

    def change(dimension, what, overrides, cost, bound, world=world_size) -> Change:
        n = world // gpus_per_node
        launch = f"NGPU={gpus_per_node} NNODES={n}" if world != world_size else ""
        return Change(dimension, what, overrides, cost, bound, world, gpus_per_node, n, launch)

    ckpt = "activation checkpointing"
    acs = []
    if ac.mode != "full" and not (ac.mode == "selective" and ac.selective_ac_option == "op"):
        acs.append(change(ckpt, f"{_ac_name(ac)} -> selective (op)", ["--activation_checkpoint.mode", "selective",
                          "--activation_checkpoint.selective_ac_option", "op"],
                          "a few % slower: norms and element-wise ops run again in backward", states))
    if ac.mode != "full":
        acs.append(change(ckpt, f"{_ac_name(ac)} -> full", ["--activation_checkpoint.mode", "full"],
                          "about a third more compute: every block's forward runs again in backward", states))
    shard = []
    if pd.dp_replicate > 1:
        shard.append(change("data-parallel sharding", f"HSDP {pd.dp_replicate} replicas -> FSDP over all "
                            f"{pd.dp_replicate * pd.dp_shard} data-parallel ranks",
                            ["--parallelism.data_parallel_replicate_degree", "1",
                             "--parallelism.data_parallel_shard_degree", "-1"],
                            "same GPUs; parameters are gathered across replicas too (more inter-node traffic)",
                            sharded(pd.dp_replicate)))
    grad_accum = resolved.grad_accum_steps
    for k in (2, 4, 8, 16, 32, 64):
        batch = keep_batch if grad_accum % k == 0 else []
        grows = "" if batch or written.training.global_batch_size != -1 else \
            f"; the global batch grows from {t.global_batch_size} to {t.global_batch_size * k} sequences"
        shard.append(change("data-parallel sharding", f"{nodes} -> {nodes * k} nodes of {gpus_per_node} GPUs "
                            f"({world_size * k} ranks)", [*free_shard, *batch],
                            f"{k}x the GPUs, about the same throughput per GPU{grows}", sharded(k),
                            world=world_size * k))
    # Tensor parallel over n of the same GPUs (data parallel shrinks as much): nothing a rank holds shrinks by more.
    tps = [change("tensor parallel", f"{pd.tp} -> {n}", ["--parallelism.tensor_parallel_degree", str(n),
                  *free_shard, *keep_batch],
                  f"same GPUs; every block gathers and scatters its activations over {n} GPUs of a node",
                  peak * pd.tp // n)
           for n in (2, 4, 8) if n > pd.tp and n % pd.tp == 0 and gpus_per_node % n == 0]
    pps = []
    for n in (2, 4, 8):
        if n > pd.pp and n % pd.pp == 0:
            micro = max(1, t.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size)
            bubble = (n - 1) / (micro + n - 1)
            pps.append(change("pipeline parallel", f"{pd.pp} -> {n}", ["--parallelism.pipeline_parallel_degree",
                              str(n), *free_shard, *keep_batch],
                              f"same GPUs; a pipeline bubble of about {bubble:.0%} of the step ({micro} micro-batches, "
                              "1F1B)", 0))  # no best case: pipeline micro-batches can cut activations by more than n
    batches = []
    b = t.local_batch_size // 2
    while b >= 1:
        steps = t.global_batch_size // (b * pd.dp_degree)
        batches.append(change("local batch",
                              f"{t.local_batch_size} -> {b} sequence{'s' * (b > 1)}, {steps} accumulation steps",
                              ["--training.local_batch_size", str(b), *keep_batch],
                              "same GPUs and global batch; smaller matmuls, FSDP gathers once per micro-batch",
                              states))
        b //= 2
    seqs = [change("sequence length", f"{t.seq_len} -> {s}", ["--training.seq_len", str(s)],
                   "changes the job: a shorter context, fewer tokens per step", states)
            for s in (t.seq_len // 2, t.seq_len // 4) if s >= 1]
    return [acs, shard, tps, pps, batches, seqs]


def _first_micro_batch(phase: str) -> bool:
    """Phases of gradient accumulation's first micro-batch, and those outside micro-batches (optimizer step)."""
    match = re.search(r"(?<!pipeline )micro-batch (\d+)/", phase)
    return match is None or match.group(1) == "1"


def _ac_name(ac) -> str:
    return f"selective ({ac.selective_ac_option})" if ac.mode == "selective" else ac.mode


def _estimate_change(ch: Change, cfg, resolved, estimate_fn: Callable, capacity_gib: float, reserve_gib: float,
                     first_pp_rank: int) -> None:
    """Estimate every pipeline rank of the changed job, the base's worst pipeline rank first, and stop at the first
    one that does not fit (the worst stage decides)."""
    ranks = representative_ranks(resolved, ch.world_size)
    ch.ranks_total = len(ranks)
    if first_pp_rank < len(ranks):
        ranks.insert(0, ranks.pop(first_pp_rank))
    for rank in ranks:
        try:
            est = estimate_fn(cfg, ch.world_size, rank)
        except ConfigError as e:  # shapes only parallelize checks (heads not divisible by tp, ...)
            ch.status, ch.reason = "invalid", str(e)
            return
        except RuntimeError as e:  # a failed estimate of one change must not hide the others: reported, not raised
            ch.status, ch.reason = "failed", str(e).strip().splitlines()[-1]
            return
        ch.ranks_estimated += 1
        if ch.peak_bytes is None or est.peak_bytes > ch.peak_bytes:
            ch.peak_bytes, ch.worst_rank = est.peak_bytes, est.rank
        ch.needed_gib = needed_gib(ch.peak_bytes, reserve_gib)
        ch.headroom_gib = capacity_gib - ch.needed_gib
        if not fits(est.peak_bytes, capacity_gib, reserve_gib):
            ch.status = "does not fit"
            return
    ch.status = "fits"


def advise(config_args: list[str], world_size: int, gpus_per_node: int, capacity_gib: float, reserve_gib: float,
           base: list, estimate_fn: Callable, max_estimates: int = DEFAULT_MAX_ESTIMATES) -> dict:
    """Changes to a job that does not fit (its config arguments, world size and base estimates: one per pipeline
    rank) that make it fit, each estimated again by `estimate_fn(cfg, world_size, rank) -> Estimate`."""
    start = time.perf_counter()
    worst = max(base, key=lambda e: e.peak_bytes)
    _, resolved = load_config(config_args, world_size)
    first_pp_rank = worst.rank // (world_size // resolved.parallel_dims.pp)
    estimates, listed = 0, []
    for dimension in _changes(config_args, world_size, gpus_per_node, base):
        for ch in dimension:
            listed.append(ch)
            try:
                cfg, res = load_config([*config_args, *ch.overrides], ch.world_size)
            except ConfigError as e:
                ch.status, ch.reason = "invalid", str(e)
                continue
            if needed_gib(ch.bound_bytes, reserve_gib) * (1 - _BOUND_SLACK) > capacity_gib:
                ch.status = "cannot fit"
                need = needed_gib(ch.bound_bytes, reserve_gib)
                ch.reason = f"even at best {ch.bound_bytes / GIB:.2f} GiB of tensors, needing {need:.2f} GiB with " \
                            f"the reserve > {capacity_gib:.2f} GiB"
                continue
            if estimates >= max_estimates:
                ch.reason = f"the search's {max_estimates} estimate(s) are spent (--advice-estimates)"
                continue
            estimates += 1
            _estimate_change(ch, cfg, res, estimate_fn, capacity_gib, reserve_gib, first_pp_rank)
            if ch.status == "fits":
                break  # the smallest change of this dimension that fits; larger ones cost more
    return {"given": True, "max_estimates": max_estimates, "estimates": estimates,
            "seconds": time.perf_counter() - start,
            "suggestions": [{**asdict(c), "paste": c.paste} for c in listed if c.status == "fits"],
            "others": [{**asdict(c), "paste": c.paste} for c in listed if c.status != "fits"]}


def not_given(reason: str) -> dict:
    return {"given": False, "reason": reason, "suggestions": [], "others": []}


def render_advice(adv: dict, script: str) -> list[str]:
    """The advice as printed: suggestions ready to paste (for the .sh wrappers; `script` takes --world-size)."""
    if not adv["given"]:
        return [f"advice: none ({adv['reason']})"]
    lines = [f"advice: changes that fit, each estimated again by the same engine, cheapest for throughput first "
             f"({adv['estimates']} of at most {adv['max_estimates']} estimates, {adv['seconds']:.1f} s):"]
    if not adv["suggestions"]:
        lines.append("  no single change below fits: combine them, or raise --advice-estimates to search further")
    for i, s in enumerate(adv["suggestions"], 1):
        lines.append(f"  {i}. {s['dimension']} {s['change']}: peak {s['peak_bytes'] / GIB:.2f} GiB (rank "
                     f"{s['worst_rank']}), needs {s['needed_gib']:.2f} GiB, headroom {s['headroom_gib']:+.2f} GiB")
        lines.append(f"     cost: {s['cost']}")
        world = f"   ({script}: --world-size {s['world_size']})" if s["launch"] else ""
        lines.append(f"     paste: {s['paste']}{world}")
    # The rest, one line per estimate and otherwise per dimension and outcome (with the first one's reason): a
    # dimension's later changes are larger versions of its first, and would repeat the same reason.
    groups: dict[tuple, list[dict]] = {}
    for i, o in enumerate(adv["others"]):
        key = (i,) if o["peak_bytes"] is not None else (o["dimension"], o["status"])
        groups.setdefault(key, []).append(o)
    for group in groups.values():
        o = group[0]
        if o["peak_bytes"] is not None:
            some = "" if o["ranks_estimated"] == o["ranks_total"] else \
                f", {o['ranks_estimated']} of {o['ranks_total']} pipeline ranks estimated"
            lines.append(f"  - {o['dimension']} {o['change']}: {o['status']} (peak {o['peak_bytes'] / GIB:.2f} GiB, "
                         f"headroom {o['headroom_gib']:+.2f} GiB{some})")
            continue
        changes = "; ".join(c["change"] for c in group[:2]) + (f" and {len(group) - 2} more" if len(group) > 2 else "")
        lines.append(f"  - {o['dimension']} {changes}: {o['status']}: {o['reason']}")
    return lines
