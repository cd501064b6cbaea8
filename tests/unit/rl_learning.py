"""SFT, then GRPO, on the synthetic arithmetic task (docs/rl.md, "Does it learn? The measured reward curve"): the
recipe tests/unit/test_rl_learns.py runs and scripts/rl_learning_study.py repeats over seeds for the docs' numbers.

Stage 1 fine-tunes the debug model with the ordinary Trainer on prompt/response records of the task, rendered exactly
as the RL loop prompts (torchtitan/rl/data.py PROMPT after BOS) with the answer as the reply, then EOS (the loop's
stop token). A fraction BARE of the replies give the bare number (" 7"), the rest the form `exact_answer` reads
(" #### 7"), so the fine-tuned policy knows most sums but states about 70% of its answers in a form the reward
cannot read: it is rewarded on about a fifth of its samples. Stage 2 runs GRPO from that checkpoint. Both stages run
on gloo ranks forked by tests/unit/forked.py.

Why the mixed answer forms (measured 2026-11-27, seeds 0-3): with every reply in the rewarded form the SFT policy is
right on 45-90% of its samples, and 20 GRPO steps of this size moved that by -0.06 to +0.18 at lr 1e-4 to 5e-4, and
lowered it on 3 of the 4 seeds at lr 1e-3 (seed 0: 0.82 -> 0.54): the sums the tiny model has not memorised are slow
for GRPO to teach at this scale, and what it gains is within the spread. Choosing the rewarded form is one decision
shared by every prompt, which GRPO learns within these 20 steps on every seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.integration.launch import read_metrics
from torchtitan.rl.data import PROMPT, synthetic_record

DIGITS, OPS = 1, "+"  # 100 questions ("What is 3 + 4?"), answers 0 .. 18
BARE = 0.7  # the fraction of SFT replies without "####"
SFT_STEPS, SFT_BATCH = 300, 16
GRPO_STEPS = 20
WINDOW = 5  # the start and end values are means over this many steps
# The whole prompt is the user turn and the whole reply the assistant's: with no template text between them, each
# is tokenized on its own (docs/finetuning.md, "Templates"), as the RL loop tokenizes its prompt and samples its
# reply. Labels: the reply and EOS (train_on assistant); the prompt is masked.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
# seq 32: the longest prompt (24 tokens) + rl.max_new_tokens 8 - 1 fits, and so does every SFT record (31 tokens).
COMMON = ["--model.name", "llama3", "--model.flavor", "debugmodel_small", "--training.seq_len", "32"]


def write_sft_data(folder: Path, seed: int) -> tuple[Path, Path]:
    """SFT_STEPS x SFT_BATCH records of the task as prompt/response lines (one epoch), and the chat template that
    renders them as the RL loop's prompt and reply."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    data, template = folder / "sft.jsonl", folder / "plain.jinja"
    with data.open("w", encoding="utf-8") as f:
        for i in range(SFT_STEPS * SFT_BATCH):
            # Another stream than the RL prompts' (seed): the 100 questions all recur in both anyway.
            rec = synthetic_record(1000 + seed, i, DIGITS, OPS)
            reply = f" {rec['answer']}" if rng.random() < BARE else f" #### {rec['answer']}"
            f.write(json.dumps({"prompt": PROMPT.format(question=rec["question"]), "response": reply}) + "\n")
    template.write_text(TEMPLATE, encoding="utf-8")
    return data, template


def sft_args(folder: Path, seed: int) -> list[str]:
    data, template = write_sft_data(folder / "data", seed)
    return COMMON + [
        "--job.dump_folder", str(folder / "sft"), "--debug.seed", str(seed),
        "--training.dataset_path", str(data), "--training.dataset_format", "prompt_response",
        "--training.chat_template", str(template), "--training.train_on", "assistant",
        "--training.local_batch_size", str(SFT_BATCH), "--training.steps", str(SFT_STEPS),
        # lr 1e-2 with the default weight decay 0.1 left some seeds short of the sums (last loss 0.25 to 0.58);
        # 5e-3 without decay: 0.20 to 0.32 (seeds 0-7).
        "--training.num_workers", "0", "--optimizer.lr", "5e-3", "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "50",
        "--checkpoint.enable", "--checkpoint.interval", str(SFT_STEPS)]


def grpo_args(checkpoint: Path, dump: Path, seed: int) -> list[str]:
    return COMMON + [
        "--job.dump_folder", str(dump), "--debug.seed", str(seed), "--checkpoint.initial_load_path", str(checkpoint),
        "--rl.synthetic_digits", str(DIGITS), "--rl.synthetic_ops", OPS, "--rl.rewards", "exact_answer",
        "--training.steps", str(GRPO_STEPS), "--rl.prompts_per_step", "8", "--rl.group_size", "8",
        "--rl.max_new_tokens", "8", "--rl.temperature", "1.0",
        # A constant 5e-4: the gain over seeds 0-7 was 0.271 +- 0.048 at 3e-4, 0.318 +- 0.036 at 5e-4, 0.228 +- 0.053
        # at 1e-3, which also unlearns sums (above); AdamW moves every weight by about lr per step, noise or not.
        "--optimizer.lr", "5e-4", "--optimizer.weight_decay", "0", "--lr_scheduler.warmup_steps", "0",
        "--lr_scheduler.min_lr_factor", "1.0", "--metrics.log_freq", "1"]


def sft_rank(rank: int, argv: list[str]) -> list[dict]:
    """One rank of the SFT stage: torchtitan/train.py's Trainer, as run_train.sh builds it; rank 0 returns the
    metrics.jsonl lines."""
    import torch

    from torchtitan.config.manager import load_config
    from torchtitan.train import Trainer

    cfg, resolved = load_config(argv, torch.distributed.get_world_size())
    trainer = Trainer(cfg, resolved, torch.device("cpu"))
    trainer.train()
    trainer.close()
    return read_metrics(cfg.job.dump_folder) if rank == 0 else []


def grpo_rank(rank: int, argv: list[str]) -> list[dict]:
    """One rank of the GRPO stage (torchtitan/rl/loop.py); rank 0 returns the metrics.jsonl lines."""
    import torch

    from torchtitan.config.preflight import check_job
    from torchtitan.rl.loop import GRPOTrainer

    cfg, resolved = check_job(argv + ["--rl.enable", "true"], torch.distributed.get_world_size(), rl=True)
    trainer = GRPOTrainer(cfg, resolved, torch.device("cpu"))
    trainer.train()
    trainer.close()
    return read_metrics(cfg.job.dump_folder) if rank == 0 else []


def start_end(metrics: list[dict], key: str = "reward_mean") -> tuple[float, float]:
    """The mean of `key` over the first and over the last WINDOW steps."""
    values = [m[key] for m in metrics]
    return sum(values[:WINDOW]) / WINDOW, sum(values[-WINDOW:]) / WINDOW
