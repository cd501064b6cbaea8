"""Routing stays balanced with each MoE family's default balancing and collapses without it (docs/models.md, "Load
balancing").

The measure is the one the console shows as `moe load`: the worst MoE layer's busiest expert over the mean load,
here averaged over the last 10 steps (full collapse: num_experts / top_k = 4.0 for both models). The bounds come
from these runs on the CI machine's kind (2026-11-27, torch 2.13 CPU, measured again after the default tokenizer
gained Llama 3's chat tokens, which re-tokenized the data; scripts/moe_balance_study.py), seed 42 as the test runs
them, seeds 1 and 2 in brackets. "Bias step 0" is the defaults with the routing-bias update at zero (the balance loss
alone: what a broken bias update leaves); "off" is no balancing at all, the test's second run:

| run | defaults | bias step 0 | off |
|---|---|---|---|
| debug_moe.toml at seq_len 128: 50 steps, off 20 | 1.60 (1.54, 1.78) | 1.98 (1.94, 2.91) | 3.22 (2.93, 3.41) |
| DeepSeek-V3 debugmodel_small, lr 2e-3: 100 steps, off 50 | 1.94 (1.94, 1.89) | 3.59 (2.27, 1.89) | 2.98 (3.74, 3.02) |

(Before the re-tokenization: debug_moe.toml 1.62, 2.48, 3.46; DeepSeek 2.20, 2.73, 3.85.)
Both models: 8 experts, top 2; Qwen3's softmax scores in debug_moe.toml, DeepSeek's sigmoid scores.
debug_moe.toml runs at half its sequence length: a step costs half as much CPU (0.46 s instead of 0.88 s), and
balances at least as well (as shipped, 60 steps: 1.89, seeds 1 and 2: 2.19, 2.07; docs/models.md). 50 steps, not
40: the load climbs to 3-3.5 by steps 10-40, and the bias brings it down only after that. The bounds sit between the
columns of seed 42: balanced below 1.85 and 2.4 (a default that balances no better than nothing fails, and at seed 42
so does a broken bias update, by 0.13 and 1.2), collapsed above 2.6 (a model that no longer collapses without
balancing fails: the test would then prove nothing). Other seeds spread as wide as these gaps, which is why the test
fixes its seed. Without balancing debug_moe.toml has collapsed by step 15 and DeepSeek by step 36, so those runs stop
at 20 and 50 steps.
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
DEBUG_MOE = ("--job.config_file", str(REPO / "train_configs" / "debug_moe.toml"), "--training.steps", "50",
             "--training.seq_len", "128")
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
    ("debug_moe_toml", DEBUG_MOE, 1.85, 2.6, "20"),
    ("deepseek_debugmodel_small", DEEPSEEK, 2.4, 2.6, "50"),
])
def test_default_balancing_holds_and_off_collapses(name, args, balanced_below, collapsed_above, off_steps, pools,
                                                   tmp_path):
    balanced = _late_load(pools, args, tmp_path / "defaults")
    collapsed = _late_load(pools, (*args, *OFF, "--training.steps", off_steps), tmp_path / "off")
    assert balanced < balanced_below, (name, balanced, collapsed)
    assert collapsed > collapsed_above, (name, balanced, collapsed)
