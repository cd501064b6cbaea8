"""Value checks of what fine-tuning and post-training add: chat data (docs/finetuning.md), LoRA and RL (docs/rl.md).
Called by torchtitan/config/validate.py's check_values; each failure is one line naming the key, and a key of a
mode that is off is refused rather than ignored."""

from __future__ import annotations

import dataclasses

from torchtitan.config.checks import _err, _one_of, _positive
from torchtitan.config.job_config import JobConfig
from torchtitan.data.stdlib_chat import CHAT_DATASETS


def check_chat_data(cfg: JobConfig) -> None:
    """dataset_format and the keys only chat data reads (docs/finetuning.md): those keys are refused on text data,
    and chat data needs one dataset_path, its own fields (no text column) and, packed, document masking."""
    t, defaults = cfg.training, JobConfig().training
    _one_of("training.dataset_format", t.dataset_format, ("text", "chat", "prompt_response", "alpaca", "auto"))
    if t.dataset_format == "text":
        for key in ("chat_template", "train_on", "sft_packing", "truncation"):
            if getattr(t, key) != getattr(defaults, key):
                _err(f"training.{key}: only read for chat data (training.dataset_format chat, prompt_response, "
                     f"alpaca or auto), and dataset_format is text")
        for key, name in (("training.dataset", t.dataset), ("validation.dataset", cfg.validation.dataset)):
            if name in CHAT_DATASETS:
                _err(f"{key}: {name} holds conversations; set training.dataset_format = chat")
        return
    fmt = t.dataset_format
    builtin = ("auto", "tokenizer", "llama3", "chatml", "deepseek_v3")
    if t.chat_template not in builtin and not t.chat_template.endswith(".jinja"):
        _err(f"training.chat_template: '{t.chat_template}' is not one of {', '.join(builtin)} or a .jinja file")
    _one_of("training.train_on", t.train_on, ("assistant", "all"))
    _one_of("training.sft_packing", t.sft_packing, ("pad", "pack"))
    _one_of("training.truncation", t.truncation, ("truncate", "drop"))
    if t.dataset_mixture:
        _err(f"training.dataset_mixture: mixtures are of text data; dataset_format {fmt} reads training.dataset_path")
    if not t.dataset_path and t.dataset not in CHAT_DATASETS:
        _err(f"training.dataset_path: dataset_format {fmt} reads conversations from local json/jsonl/parquet files "
             f"or a hub dataset (or training.dataset = {CHAT_DATASETS[0]}); the other registry datasets are text")
    if not t.dataset_path and fmt not in ("chat", "auto"):
        _err(f"training.dataset_format: {t.dataset} holds chat messages, not {fmt} records; set it to chat")
    if t.dataset_text_column != defaults.dataset_text_column:
        _err(f"training.dataset_text_column: not read with dataset_format {fmt} (its records have fixed fields: "
             "docs/finetuning.md)")
    v = cfg.validation
    if v.enable and not v.dataset_path and v.dataset not in CHAT_DATASETS:
        _err(f"validation.dataset_path: with dataset_format {fmt}, validation reads held-out conversations of the "
             f"same format from local files or a hub dataset (or validation.dataset = {CHAT_DATASETS[1]}); the other "
             "registry datasets are text")
    if v.enable and v.dataset_text_column != JobConfig().validation.dataset_text_column:
        _err(f"validation.dataset_text_column: not read with dataset_format {fmt} (conversations have fixed fields)")
    if t.sft_packing == "pack" and cfg.model.attn_mask_type != "block_causal":
        _err("training.sft_packing: pack puts several conversations in a row and needs model.attn_mask_type = "
             "block_causal so that none attends to another (or use sft_packing = pad)")


def check_lora(cfg: JobConfig) -> None:
    lo, default = cfg.lora, type(cfg.lora)()
    if "lora" not in cfg.model.converters:  # no [lora] key is accepted and then ignored
        for key in (f.name for f in dataclasses.fields(lo)):
            if getattr(lo, key) != getattr(default, key):
                _err(f"lora.{key}: set, but model.converters does not include \"lora\"")
        return
    _positive("lora.rank", lo.rank)
    _positive("lora.alpha", lo.alpha)
    if not 0.0 <= lo.dropout < 1.0:
        _err(f"lora.dropout: must be in [0, 1), got {lo.dropout}")
    if not lo.target_modules or ("all-linear" in lo.target_modules and len(lo.target_modules) > 1):
        _err(f"lora.target_modules: {lo.target_modules}: give module names (e.g. wq, wv) or [\"all-linear\"] alone")
    if "output" in lo.target_modules:
        _err("lora.target_modules: the output projection never gets an adapter")
    if "float8" in cfg.model.converters:
        _err("model.converters: lora with float8 is not supported yet (the adapter wraps a plain Linear)")
    # A resume loads the base weights again from initial_load_path, then the adapters over them.
    if lo.save_adapter_only and not (cfg.checkpoint.enable and cfg.checkpoint.initial_load_path):
        _err("lora.save_adapter_only: needs checkpoint.enable and checkpoint.initial_load_path (the base weights a "
             "resumed run loads before the adapters)")


def check_rl(cfg: JobConfig) -> None:
    rl, default = cfg.rl, type(cfg.rl)()
    if not rl.enable:  # no [rl] key is accepted and then ignored by the pretraining trainer
        for key in (f.name for f in dataclasses.fields(rl)):
            if getattr(rl, key) != getattr(default, key):
                _err(f"rl.{key}: set, but rl.enable is false (RL runs through python -m torchtitan.rl.train)")
        return
    # RL trains with data parallelism and tensor parallel (docs/rl.md); its update runs whole sequences per rank (in
    # micro-batches), and nothing else is built or tested for it.
    p = cfg.parallelism
    if p.pipeline_parallel_degree > 1:
        _err(f"parallelism.pipeline_parallel_degree={p.pipeline_parallel_degree}: RL has no pipeline schedule; use "
             "FSDP and tensor parallel")
    if p.context_parallel_degree > 1:
        _err(f"parallelism.context_parallel_degree={p.context_parallel_degree}: RL does not split sequences; use "
             "FSDP and tensor parallel")
    if p.expert_parallel_degree > 1:
        _err(f"parallelism.expert_parallel_degree={p.expert_parallel_degree}: RL does not support expert parallel "
             "yet; use FSDP and tensor parallel")
    if rl.group_size < 2:
        _err(f"rl.group_size: must be >= 2 (advantages compare completions of one prompt), got {rl.group_size}")
    _positive("rl.prompts_per_step", rl.prompts_per_step)
    if rl.train_groups < 0:
        _err(f"rl.train_groups: must be >= 0 (0: prompts_per_step), got {rl.train_groups}")
    _positive("rl.ppo_epochs", rl.ppo_epochs)
    groups = rl.train_groups or rl.prompts_per_step
    if rl.mini_batch_size < 0 or (rl.mini_batch_size and groups % rl.mini_batch_size):
        _err(f"rl.mini_batch_size: must be 0 (one optimizer step per pass) or divide the {groups} groups of a step "
             f"(rl.train_groups, or rl.prompts_per_step), got {rl.mini_batch_size}")
    if rl.micro_batch_size < 0:
        _err(f"rl.micro_batch_size: must be >= 0 (0: each rank's whole share at once), got {rl.micro_batch_size}")
    _positive("rl.max_new_tokens", rl.max_new_tokens)
    _positive("rl.temperature", rl.temperature)
    if not 0.0 < rl.top_p <= 1.0:
        _err(f"rl.top_p: must be in (0, 1], got {rl.top_p}")
    if not 0.0 <= rl.clip_low < 1.0:
        _err(f"rl.clip_low: must be in [0, 1), got {rl.clip_low}")
    if rl.clip_high < 0.0:
        _err(f"rl.clip_high: must be >= 0, got {rl.clip_high}")
    if rl.kl_coeff < 0.0:
        _err(f"rl.kl_coeff: must be >= 0, got {rl.kl_coeff}")
    _one_of("rl.loss_aggregation", rl.loss_aggregation, ("token", "sequence"))
    _one_of("rl.buffer_sampling", rl.buffer_sampling, ("fifo", "uniform", "prioritized"))
    if rl.buffer_capacity < 0:
        _err(f"rl.buffer_capacity: must be >= 0 (0: unbounded), got {rl.buffer_capacity}")
    if rl.buffer_max_lag < -1:
        _err(f"rl.buffer_max_lag: must be >= -1 (-1: no limit), got {rl.buffer_max_lag}")
    if not rl.rewards:
        _err("rl.rewards: name at least one reward function")
    if rl.reward_weights and len(rl.reward_weights) != len(rl.rewards):
        _err(f"rl.reward_weights: {len(rl.reward_weights)} weights for {len(rl.rewards)} rewards")
    _one_of("rl.task", rl.task, ("synthetic", "gsm8k"))
    if rl.task == "gsm8k" and not rl.dataset_path:
        _err("rl.dataset_path: rl.task gsm8k needs a .jsonl file or a hub dataset name")
    _positive("rl.synthetic_digits", rl.synthetic_digits)
    if not rl.synthetic_ops or set(rl.synthetic_ops) - set("+-*"):
        _err(f"rl.synthetic_ops: '{rl.synthetic_ops}' must be some of + - *")
