"""Advice of the memory estimator and the dry run (torchtitan/estimation/advice.py) and their exit codes.

The search itself (order, budget, the config checks, pipeline ranks, what gets estimated) runs against a made-up
estimate function: memory as a formula of the layout, no tracing, milliseconds. The done-when of the issue runs the
real thing: scripts/estimate_memory.py on the debug model with too little memory, then every suggestion, as pasted,
estimated again by the script (each run in a child of the test fork server, as tests/unit/test_dry_run.py does).
"""

from __future__ import annotations

import copy
import json
import shlex
import sys
from pathlib import Path

from tests.unit.forked import run_main
from torchtitan.config.manager import load_config
from torchtitan.config.resolve import resolve
from torchtitan.estimation import advice
from torchtitan.estimation.engine import Estimate, StepPeak

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
DEBUG = ["--model.flavor", "debugmodel", "--training.seq_len", "64"]
_AC = {"none": 8, "selective": 4, "full": 1}


def _fake_estimates(calls: list):
    """A made-up engine: 64 MiB of states split over dp_shard x tp x pp, activations of lb x seq tokens cut by AC and
    tp (a pipeline rank holds its own and the later stages' micro-batches in flight), and 20 MiB of loss on the last
    stage that no checkpointing removes, so that full AC makes the last pipeline stage the worst one."""
    def estimate_fn(cfg, world_size, rank):
        calls.append((cfg.activation_checkpoint.mode, world_size, rank))
        pd = resolve(copy.deepcopy(cfg), world_size).parallel_dims
        pp_rank = rank // (world_size // pd.pp)
        states = 64 * MIB // (pd.dp_shard * pd.tp * pd.pp)
        tokens = cfg.training.local_batch_size * cfg.training.seq_len / 512
        act = round(tokens * _AC[cfg.activation_checkpoint.mode] * 16 * MIB / pd.tp * (pd.pp - pp_rank) / pd.pp)
        loss = 20 * MIB if pp_rank == pd.pp - 1 else 0
        peak = states + act + loss
        breakdown = {"parameters": states // 4, "gradients": states // 4, "optimizer_state": states // 2,
                     "activations": act + loss}
        return Estimate(rank, world_size, {"step": StepPeak(peak, "backward", breakdown)},
                        {"parameters": states // 4, "gradients": states // 4, "optimizer_state": states // 2})
    return estimate_fn


def _advise(args: list[str], world: int, capacity_mib: float, max_estimates: int, gpus_per_node: int | None = None):
    calls: list = []
    fn = _fake_estimates(calls)
    cfg, resolved = load_config(args, world)
    base = [fn(cfg, world, r) for r in range(0, world, world // resolved.parallel_dims.pp)]
    calls.clear()
    adv = advice.advise(args, world, gpus_per_node or world, capacity_mib / 1024, 0.0, base, fn, max_estimates)
    return adv, calls


def test_search_order_budget_config_checks_and_kept_global_batch():
    # 32 MiB states + 128 activations + 20 loss = 180 MiB against 100: per-op AC 116, full AC 68 (fits: the
    # dimension stops there), more nodes can only shrink the 32 MiB of states (never enough: skipped unestimated),
    # TP 2 116, PP 2 160 on its first stage, local batch 4 116 and 2 84 (fits); the budget of 6 is spent then.
    args = [*DEBUG, "--parallelism.data_parallel_shard_degree", "2"]
    adv, calls = _advise(args, 2, 100, 6)
    assert [(s["dimension"], s["change"]) for s in adv["suggestions"]] == [
        ("activation checkpointing", "none -> full"), ("local batch", "8 -> 2 sequences, 4 accumulation steps")]
    full, batch = adv["suggestions"]
    assert (full["peak_bytes"], full["paste"], full["launch"]) == (68 * MIB, "--activation_checkpoint.mode full", "")
    assert (batch["peak_bytes"], batch["paste"]) == (84 * MIB, "--training.local_batch_size 2 "
                                                     "--training.global_batch_size 16")
    others = {(o["dimension"], o["change"]): o for o in adv["others"]}
    assert len(calls) == adv["estimates"] == 6 and all(world == 2 for _, world, _ in calls)
    assert others[("activation checkpointing", "none -> selective (op)")]["peak_bytes"] == 116 * MIB
    nodes = [o for o in adv["others"] if o["dimension"] == "data-parallel sharding"]
    assert len(nodes) == 6 and {o["status"] for o in nodes} == {"cannot fit"}
    assert nodes[0]["launch"] == "NGPU=2 NNODES=2" and "grows from 16 to 32" in nodes[0]["cost"]
    # Fewer data-parallel ranks: the global batch stays (more accumulation), the fixed dp_shard takes the leftover.
    tp = others[("tensor parallel", "1 -> 2")]
    assert tp["status"] == "does not fit" and tp["overrides"] == [
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "-1",
        "--training.global_batch_size", "16"]
    assert others[("pipeline parallel", "1 -> 4")]["status"] == "invalid"  # 4 stages on 2 ranks: never estimated
    assert "does not divide the world size 2" in others[("pipeline parallel", "1 -> 4")]["reason"]
    assert [o["change"] for o in adv["others"] if o["dimension"] == "local batch"] == ["8 -> 4 sequences, 2 "
                                                                                      "accumulation steps"]
    text = "\n".join(advice.render_advice(adv, "scripts/estimate_memory.py"))
    assert "1. activation checkpointing none -> full: peak 0.07 GiB" in text
    assert "paste: --activation_checkpoint.mode full\n" in text and "(6 of at most 6 estimates" in text
    assert "sequence length 64 -> 32; 64 -> 16: not estimated" in text


def test_pipeline_advice_needs_every_pipeline_rank_to_fit():
    # pp 2 x FSDP 2: pipeline rank 0 peaks at 80 MiB, rank 1 at 68. Per-op AC: rank 0 48 (> 45 MiB: rank 1 is not
    # estimated); full AC: rank 0 24 but the last stage 40, which decides (it fits 45 MiB, not 38).
    args = [*DEBUG, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"]
    adv, calls = _advise(args, 4, 45, 2)
    assert calls == [("selective", 4, 0), ("full", 4, 0), ("full", 4, 2)]
    [full] = adv["suggestions"]
    assert (full["change"], full["peak_bytes"], full["worst_rank"]) == ("none -> full", 40 * MIB, 2)
    op = adv["others"][0]
    assert (op["status"], op["ranks_estimated"], op["ranks_total"]) == ("does not fit", 1, 2)
    assert "1 of 2 pipeline ranks estimated" in "\n".join(advice.render_advice(adv, "scripts/dry_run.py"))
    adv, calls = _advise(args, 4, 38, 2)
    assert adv["suggestions"] == [] and len(calls) == 3
    assert [(o["status"], o["peak_bytes"], o["ranks_estimated"]) for o in adv["others"][:2]] == \
        [("does not fit", 48 * MIB, 1), ("does not fit", 40 * MIB, 2)]


def test_hsdp_folds_into_fsdp_on_the_same_gpus_before_adding_nodes():
    args = [*DEBUG, "--parallelism.data_parallel_replicate_degree", "2", "--activation_checkpoint.mode", "full"]
    adv, calls = _advise(args, 4, 60, 1, gpus_per_node=2)
    # 32 MiB of states (dp_shard 2) + 16 + 20 = 68: folding the 2 replicas into dp_shard 4 leaves 16 MiB, 52 in all
    [fold] = adv["suggestions"]
    assert fold["overrides"] == ["--parallelism.data_parallel_replicate_degree", "1",
                                 "--parallelism.data_parallel_shard_degree", "-1"]
    assert (fold["world_size"], fold["peak_bytes"], calls) == (4, 52 * MIB, [("full", 4, 0)])
    # the dimension stops at its first change that fits: no more nodes tried or listed
    assert not [o for o in adv["others"] if o["dimension"] == "data-parallel sharding"]


# ---- the real estimator ------------------------------------------------------------------------------------------
def _script(path: str, args: list[str]) -> None:
    import runpy

    sys.argv = [path, *args]
    runpy.run_path(path, run_name="__main__")


def _run(path: str, args: list[str]) -> tuple[int, str, str]:
    return run_main(_script, path, args, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                              "HF_HUB_OFFLINE": "1"}, cwd=REPO, timeout=240)


def test_estimator_advice_every_suggestion_fits_when_estimated_again():
    # The debug model on 2 ranks (FSDP, 8 x 64 tokens, fp32) peaks at 0.141 GiB: 0.125 does not hold it. Per-op AC
    # (0.124 GiB) and a second node (FSDP over 4 ranks: 0.121) fit; the budget of 2 ends the search there.
    target = ["--device", "cpu", "--memory-gib", "0.125", *DEBUG]
    code, out, err = _run("scripts/estimate_memory.py", ["--world-size", "2", *target, "--advice-estimates", "2",
                                                         "--json"])
    assert code == advice.EXIT_DOES_NOT_FIT, err[-3000:]
    report = json.loads(out)
    adv = report["advice"]
    assert report["fits"] is False and adv["given"] and adv["estimates"] == 2
    suggestions = adv["suggestions"]
    assert [s["dimension"] for s in suggestions] == ["activation checkpointing", "data-parallel sharding"]
    for s in suggestions:
        # as a user pastes it after ./scripts/estimate_memory.sh: NGPU / NNODES set the world, the rest overrides
        words = shlex.split(s["paste"])
        launch = dict(w.split("=") for w in words if w.startswith(("NGPU=", "NNODES=")))
        world = int(launch.get("NGPU", 2)) * int(launch.get("NNODES", 1))
        overrides = [w for w in words if not w.startswith(("NGPU=", "NNODES="))]
        again_code, again, err = _run("scripts/estimate_memory.py", ["--world-size", str(world), *target,
                                                                     *overrides, "--json"])
        assert again_code == advice.EXIT_FITS, (s["paste"], err[-3000:])
        again = json.loads(again)
        assert again["fits"] is True and again["peak_bytes"] == s["peak_bytes"] and again["world_size"] == world
