"""The offline debug fine-tuning recipes (train_configs/debug_sft.toml, debug_lora.toml; docs/finetuning.md) as a user
runs them, shortened: full SFT of the debug model on python_stdlib_chat lowers the loss on held-out conversations'
assistant replies, and LoRA, adapting that result with adapter-only checkpoints, lowers it further while the base
weights stay as loaded. One process each (the recipes' FSDP degree follows the world size); CPU, no network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.forked import run_main

REPO = Path(__file__).resolve().parents[2]
# Shorter rows and batches than the recipes' (512 x 4): the first steps still move the held-out loss by nats.
SHAPE = ("--training.seq_len", "256", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--training.num_workers", "0")
SFT_STEPS, LORA_STEPS = 8, 6


def _train(argv: list[str]) -> None:
    from torchtitan.train import main

    main(argv)


def _run(recipe: str, dump: Path, cache: Path, *overrides: str) -> list[dict]:
    argv = ["--job.config_file", str(REPO / "train_configs" / recipe), "--job.dump_folder", str(dump), *SHAPE,
            *overrides]
    code, _, err = run_main(_train, argv, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                               "TORCHTITAN_CACHE_DIR": str(cache)}, cwd=REPO)
    assert code == 0, err[-3000:]
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _val_losses(metrics: list[dict]) -> list[float]:
    return [m["val_loss"] for m in metrics if "val_loss" in m]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sft_then_lora_debug_recipes_lower_the_held_out_loss(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    cache = tmp_path / "cache"
    sft = _run("debug_sft.toml", tmp_path / "sft", cache, "--training.steps", str(SFT_STEPS), "--validation.freq",
               str(SFT_STEPS // 2), "--checkpoint.interval", str(SFT_STEPS))
    first, last = _val_losses(sft)
    # From a random model (9.0 nats = ln 8192) the replies' loss falls by well over a nat in these steps; a run
    # whose labels or masking were wrong, or that did not learn, would not.
    assert last < first - 0.5 and first < 9.0, (first, last)
    assert all(m["loss"] > 0 for m in sft)

    base = tmp_path / "sft" / "checkpoint" / f"step-{SFT_STEPS}"
    lora = _run("debug_lora.toml", tmp_path / "lora", cache, "--training.steps", str(LORA_STEPS),
                "--validation.freq", str(LORA_STEPS), "--checkpoint.enable", "true", "--checkpoint.initial_load_path",
                str(base), "--lora.save_adapter_only", "true", "--checkpoint.interval", str(LORA_STEPS))
    (adapted,) = _val_losses(lora)
    assert adapted < last - 0.1, (last, adapted)  # it starts from the SFT result and improves on it
    print(f"held-out reply loss: SFT {first:.3f} -> {last:.3f}, then LoRA {adapted:.3f}")

    # Adapter-only: the checkpoint holds the adapters and no base weight, a small fraction of the SFT checkpoint.
    saved = FileSystemReader(str(tmp_path / "lora" / "checkpoint" / f"step-{LORA_STEPS}")).read_metadata()
    weights = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert weights and all("lora_" in k for k in weights), weights[:5]
    size = sum(f.stat().st_size for f in (tmp_path / "lora" / "checkpoint" / f"step-{LORA_STEPS}").iterdir())
    assert size < 0.5 * sum(f.stat().st_size for f in base.iterdir())
