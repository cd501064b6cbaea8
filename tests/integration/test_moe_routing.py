"""Routing stays balanced with each MoE family's default balancing and collapses without it (docs/models.md, "Load
balancing").

The measure is the one the console shows as `moe load`: the worst MoE layer's busiest expert over the mean load,
here averaged over the last 10 steps (full collapse: num_experts / top_k = 4.0 for both models). The bounds come
from these runs on the CI machine's kind (2026-11-26, torch 2.13 CPU; the same numbers from
scripts/moe_balance_study.py):

| run | defaults | balancing off |
|---|---|---|
| train_configs/debug_moe.toml as shipped (Qwen3, 8 experts, top 2, 60 steps) | 1.89 | 3.93 (3.95 by steps 11-20) |
| DeepSeek-V3 debugmodel_small (8 experts, top 2, sigmoid scores), 100 steps at lr 2e-3 | 2.15 | 3.33 |

The debug_moe.toml bound, 2.0, is the target for the shipped debug config (these runs are deterministic on one
machine; with seeds 1 and 2 instead of the config's 42 the defaults gave 2.19 and 2.07, so the margin is that of
this seed). The other bounds sit between the two columns with room for the spread between runs of neighbouring
settings (+-0.3): a default that balances no better than nothing fails, and so does a model that no longer collapses
without balancing (the test would then prove nothing). Without balancing debug_moe.toml has collapsed by step 20,
so that run stops there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.parity import run_layout

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OFF = ("--moe.load_balance_coeff", "0", "--moe.aux_loss_coeff", "0", "--moe.router_z_loss_coeff", "0")
RUN = ("--metrics.log_freq", "1", "--job.print_config", "false", "--checkpoint.enable", "false",
       "--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", "120")
DEBUG_MOE = ("--job.config_file", str(REPO / "train_configs" / "debug_moe.toml"), "--training.steps", "60")
DEEPSEEK = ("--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.name", "deepseek_v3",
            "--model.flavor", "debugmodel_small", "--training.steps", "100", "--training.seq_len", "64",
            "--training.local_batch_size", "8", "--optimizer.lr", "2e-3", "--lr_scheduler.warmup_steps", "2")


def _late_load(pools, args, dump) -> float:
    """Mean over the last 10 steps of the worst layer's max/mean expert load, trained on one process."""
    run = pools.get(1).run(run_layout, [*args, *RUN], str(dump), (), "success", False, timeout=600.0)[0]
    loads = [m["moe_load_max_over_mean"] for m in run["metrics"]][-10:]
    assert len(loads) == 10 and all(m["moe_idle_experts_max"] >= 0 for m in run["metrics"])
    return sum(loads) / len(loads)


@pytest.mark.parametrize(("name", "args", "balanced_below", "collapsed_above", "off_steps"), [
    ("debug_moe_toml", DEBUG_MOE, 2.0, 3.5, "20"),
    ("deepseek_debugmodel_small", DEEPSEEK, 2.7, 3.0, "100"),
])
def test_default_balancing_holds_and_off_collapses(name, args, balanced_below, collapsed_above, off_steps, pools,
                                                   tmp_path):
    balanced = _late_load(pools, args, tmp_path / "defaults")
    collapsed = _late_load(pools, (*args, *OFF, "--training.steps", off_steps), tmp_path / "off")
    assert balanced < balanced_below, (name, balanced, collapsed)
    assert collapsed > collapsed_above, (name, balanced, collapsed)
