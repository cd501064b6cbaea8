"""Value checks on a JobConfig; each failure is one line naming the key.

`check_values` checks what the sources spell out, each key on its own or against keys that are never derived
(a -1 left to be derived passes as such). `check_resolved` checks what depends on derived values, after
torchtitan/config/resolve.py filled them in; it reads resolved values only. Checks that need the world size
(degrees that must divide it) live in ParallelDims, which resolve builds. All of it runs before any process
group exists.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torchtitan.config.checks import _err, _not_yet, _one_of, _positive
from torchtitan.config.flavor import flavor_args
from torchtitan.config.job_config import JobConfig
from torchtitan.config.moe import check_moe
from torchtitan.config.validate_finetune import check_chat_data, check_lora, check_rl
from torchtitan.distributed.pipeline_parallel import SCHEDULES
from torchtitan.models.registry import get_model_spec

# Keys of features still to come -> the feature. They parse, so existing TOML files load, but any value other than
# the default is an error, whether or not the feature's degree is on: a key that is accepted and then read by
# nothing would run something other than what the file asks for. tests/unit/test_config_keys_used.py holds every
# key to this: read by the code, or refused here.
NOT_YET: dict[str, str] = {
    "parallelism.context_parallel_rotate_method": "torch's rotating context-parallel attention (the all-gather one "
                                                  "is built in: docs/parallelism.md)",
    "optimizer.early_step_in_backward": "stepping in backward",
    "training.enable_cpu_offload": "CPU offload",
    "memory_estimation.disable_fake_mode": "estimating with real tensors",
}


def _check_not_yet(cfg: JobConfig) -> None:
    defaults = JobConfig()
    for key, feature in NOT_YET.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != getattr(getattr(defaults, section), name):
            _not_yet(key, feature)


def check_values(cfg: JobConfig) -> None:
    _check_model(cfg)
    _check_optimizer(cfg)
    _check_training(cfg)
    _check_parallelism(cfg)
    _check_unavailable(cfg)
    _check_not_yet(cfg)  # after the range checks: a degree of 0 is invalid, not a feature still to come
    _check_checkpoint(cfg)
    _check_profiling(cfg)
    _check_float8(cfg)
    check_lora(cfg)
    check_rl(cfg)
    check_moe(cfg)
    _positive("metrics.log_freq", cfg.metrics.log_freq)
    _positive("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
    _positive("comm.train_timeout_seconds", cfg.comm.train_timeout_seconds)
    if not cfg.memory_estimation.device_memory_gib >= 0.0:
        _err(f"memory_estimation.device_memory_gib: must be >= 0 (0 = this machine's), got "
             f"{cfg.memory_estimation.device_memory_gib}")
    if not cfg.memory_estimation.expert_load_factor >= 1.0:
        _err(f"memory_estimation.expert_load_factor: must be >= 1 (1 = balanced routing), got "
             f"{cfg.memory_estimation.expert_load_factor}")


def _check_model(cfg: JobConfig) -> None:
    try:
        spec = get_model_spec(cfg.model.name)
    except KeyError as e:
        _err(str(e.args[0]))
    if cfg.model.flavor not in spec.flavors:
        _err(f"model.flavor: unknown flavor '{cfg.model.flavor}' of {spec.name}; known: {', '.join(spec.flavors)}")
    if cfg.model.n_layers < 0:
        _err(f"model.n_layers: must be >= 0 (0 = the flavor's {spec.flavors[cfg.model.flavor].n_layers}), got "
             f"{cfg.model.n_layers}")
    _one_of("model.attn_mask_type", cfg.model.attn_mask_type, ("causal", "block_causal"))


def _check_optimizer(cfg: JobConfig) -> None:
    o = cfg.optimizer
    _one_of("optimizer.name", o.name, ("AdamW", "Adam"))
    _one_of("optimizer.implementation", o.implementation, ("fused", "foreach", "for-loop"))
    _positive("optimizer.lr", o.lr)
    _positive("optimizer.eps", o.eps)
    for key, beta in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        if not 0.0 <= beta < 1.0:
            _err(f"{key}: must be in [0, 1), got {beta}")
    if o.weight_decay < 0:
        _err(f"optimizer.weight_decay: must be >= 0, got {o.weight_decay}")
    s = cfg.lr_scheduler
    _one_of("lr_scheduler.decay_type", s.decay_type, ("linear", "sqrt", "cosine"))
    if s.warmup_steps < 0:
        _err(f"lr_scheduler.warmup_steps: must be >= 0, got {s.warmup_steps}")
    if s.decay_ratio is not None and not 0.0 <= s.decay_ratio <= 1.0:
        _err(f"lr_scheduler.decay_ratio: must be in [0, 1], got {s.decay_ratio}")
    if not 0.0 <= s.min_lr_factor <= 1.0:
        _err(f"lr_scheduler.min_lr_factor: must be in [0, 1], got {s.min_lr_factor}")


def _check_training(cfg: JobConfig) -> None:
    t = cfg.training
    _positive("training.local_batch_size", t.local_batch_size)
    _positive("training.seq_len", t.seq_len)
    _positive("training.steps", t.steps)
    _positive("training.gc_freq", t.gc_freq)
    if t.global_batch_size != -1 and t.global_batch_size <= 0:
        _err(f"training.global_batch_size: must be -1 or > 0, got {t.global_batch_size}")
    _one_of("training.mixed_precision_param", t.mixed_precision_param, ("bfloat16", "float32"))
    _one_of("training.mixed_precision_reduce", t.mixed_precision_reduce, ("float32", "bfloat16"))
    _one_of("training.dataset_streaming", t.dataset_streaming, ("auto", "true", "false"))
    _one_of("training.on_nonfinite", t.on_nonfinite, ("stop", "skip"))
    if t.num_workers < -1:
        _err(f"training.num_workers: must be >= 0, or -1 (2 on GPU, 0 on CPU), got {t.num_workers}")
    if t.loss_chunks < 0:
        _err(f"training.loss_chunks: must be >= 0 (0 = auto), got {t.loss_chunks}")
    if t.dataset_mixture:
        _check_mixture(cfg)
    check_chat_data(cfg)
    v = cfg.validation
    _one_of("validation.dataset_streaming", v.dataset_streaming, ("auto", "true", "false"))
    if v.enable:
        _positive("validation.freq", v.freq)
        if v.steps == 0 or v.steps < -1:
            _err(f"validation.steps: must be -1 (one full pass) or > 0, got {v.steps}")
        for key in ("local_batch_size", "seq_len"):
            if getattr(v, key) == 0 or getattr(v, key) < -1:
                _err(f"validation.{key}: must be -1 (same as training) or > 0, got {getattr(v, key)}")


def _check_mixture(cfg: JobConfig) -> None:
    from torchtitan.data.mixture import parse_mixture  # here: it imports torch

    t = cfg.training
    if t.dataset_path or t.dataset != JobConfig().training.dataset:
        _err("training.dataset_mixture: set it or training.dataset / training.dataset_path, not both")
    try:
        parse_mixture(t.dataset_mixture)
    except ValueError as e:
        _err(str(e))


def _check_parallelism(cfg: JobConfig) -> None:
    p = cfg.parallelism
    _one_of("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward, ("default", "always", "never"))
    _one_of("parallelism.context_parallel_rotate_method", p.context_parallel_rotate_method, ("allgather", "alltoall"))
    _one_of("parallelism.pipeline_parallel_schedule", p.pipeline_parallel_schedule, SCHEDULES)
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        _err(f"parallelism.data_parallel_shard_degree: must be -1 or >= 1, got {p.data_parallel_shard_degree}")
    for key in (
        "data_parallel_replicate_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
    ):
        if getattr(p, key) < 1:
            _err(f"parallelism.{key}: must be >= 1, got {getattr(p, key)}")
    _check_tensor_parallel(cfg)
    _check_context_parallel(cfg, {"training.seq_len": cfg.training.seq_len})
    _check_expert_parallel(cfg)


def _check_expert_parallel(cfg: JobConfig) -> None:
    """Expert parallel needs MoE layers whose experts divide over the ep ranks, expert tensor parallel MoE layers
    whose hidden size divides over the tp ranks; the mesh conditions are ParallelDims's
    (torchtitan/distributed/parallel_dims.py)."""
    etp = cfg.parallelism.expert_tensor_parallel_degree
    if etp > 1:
        moe = getattr(get_model_spec(cfg.model.name).flavors[cfg.model.flavor], "moe", None)
        if moe is None:
            _err(f"parallelism.expert_tensor_parallel_degree={etp}: {cfg.model.name}/{cfg.model.flavor} has no MoE "
                 "layers")
        if moe.hidden_dim % etp:
            _err(f"parallelism.expert_tensor_parallel_degree={etp} does not divide the experts' hidden size "
                 f"{moe.hidden_dim} of {cfg.model.name}/{cfg.model.flavor}")
    ep = cfg.parallelism.expert_parallel_degree
    if ep == 1:
        return
    moe = getattr(get_model_spec(cfg.model.name).flavors[cfg.model.flavor], "moe", None)
    if moe is None:
        _err(f"parallelism.expert_parallel_degree={ep}: {cfg.model.name}/{cfg.model.flavor} has no MoE layers")
    if moe.num_experts % ep:
        _err(f"parallelism.expert_parallel_degree={ep} does not divide the {moe.num_experts} experts of "
             f"{cfg.model.name}/{cfg.model.flavor}")


def _check_context_parallel(cfg: JobConfig, seq_lens: dict[str, int]) -> None:
    """Context parallel cuts each sequence into 2 x cp chunks (head-tail balancing); with sequence parallel each
    rank's S / cp tokens are cut again by tp."""
    p = cfg.parallelism
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if cp == 1:
        return
    for key, seq_len in seq_lens.items():
        if seq_len % (2 * cp):
            _err(f"{key}={seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp} (each rank holds two "
                 "chunks of every sequence, one early and one late, to even out causal attention)")
        if tp > 1 and (seq_len // cp) % tp:
            _err(f"{key}={seq_len} over context_parallel_degree={cp} leaves {seq_len // cp} tokens per rank, not "
                 f"divisible by tensor_parallel_degree={tp} (sequence parallel)")


def _check_tensor_parallel(cfg: JobConfig) -> None:
    p = cfg.parallelism
    if p.enable_async_tensor_parallel:
        if p.tensor_parallel_degree == 1:
            _err("parallelism.enable_async_tensor_parallel: needs parallelism.tensor_parallel_degree > 1")
        if not (cfg.compile.enable and "model" in cfg.compile.components):
            _err("parallelism.enable_async_tensor_parallel: needs compile.enable = true with 'model' in "
                 "compile.components (inductor does the overlap)")
    if p.tensor_parallel_degree == 1:
        return
    _check_tp_divides(cfg, {"training.seq_len": cfg.training.seq_len})


def tp_divisibility_errors(model_args, tp: int, seq_lens: dict[str, int]) -> list[str]:
    """What the tensor-parallel plan (torchtitan/distributed/tensor_parallel.py: heads, KV heads, feed-forward units
    and vocabulary split over tp, the sequence sharded between blocks) needs from the model shape; one message per
    violated rule (empty = fine). Here, not there, because it runs before torch is imported.

    `seq_lens` maps a config key (e.g. "training.seq_len") to its value: sequence parallel shards it by tp.
    """
    if tp == 1:
        return []
    errors = []
    kv = model_args.num_kv_heads
    if model_args.n_heads % tp:
        errors.append(f"n_heads={model_args.n_heads} is not divisible by tensor_parallel_degree={tp}")
    if kv % tp:
        hint = " (GQA: each rank needs at least one whole KV head)" if kv < tp else ""
        errors.append(f"n_kv_heads={kv} is not divisible by tensor_parallel_degree={tp}{hint}")
    if model_args.ffn_hidden_dim % tp:
        errors.append(f"the feed-forward hidden size {model_args.ffn_hidden_dim} is not divisible by "
                      f"tensor_parallel_degree={tp}")
    if model_args.vocab_size % tp:
        errors.append(f"vocab_size={model_args.vocab_size} is not divisible by tensor_parallel_degree={tp} "
                      "(embedding and output are sharded on the vocabulary)")
    for key, seq_len in seq_lens.items():
        if seq_len % tp:
            errors.append(f"{key}={seq_len} is not divisible by tensor_parallel_degree={tp} "
                          "(sequence parallel shards activations on the sequence)")
    return errors


def _check_tp_divides(cfg: JobConfig, seq_lens: dict[str, int]) -> None:
    """The model's dimensions and the given sequence lengths must divide by the TP degree."""
    tp = cfg.parallelism.tensor_parallel_degree
    spec = get_model_spec(cfg.model.name)
    if not spec.supports_tensor_parallel:
        _err(f"parallelism.tensor_parallel_degree={tp}: model {cfg.model.name} has no tensor-parallel plan yet")
    errors = tp_divisibility_errors(flavor_args(cfg), tp, seq_lens)
    if errors:
        _err(f"parallelism.tensor_parallel_degree={tp} with model {cfg.model.name}/{cfg.model.flavor}: {errors[0]}")


def check_resolved(cfg: JobConfig) -> None:
    """Checks of derived values, on a config that torchtitan/config/resolve.py filled in."""
    v = cfg.validation
    if v.enable and cfg.parallelism.tensor_parallel_degree > 1:
        _check_tp_divides(cfg, {"validation.seq_len": v.seq_len})
    if v.enable:
        _check_context_parallel(cfg, {"validation.seq_len": v.seq_len})


def _check_unavailable(cfg: JobConfig) -> None:
    _one_of("activation_checkpoint.mode", cfg.activation_checkpoint.mode, ("none", "selective", "full"))
    opt = cfg.activation_checkpoint.selective_ac_option
    if cfg.activation_checkpoint.mode == "selective" and opt != "op" and not (opt.isdigit() and int(opt) >= 1):
        _err(f"activation_checkpoint.selective_ac_option: '{opt}' is neither 'op' nor a block interval >= 1")
    unknown = set(cfg.compile.components) - {"model", "loss"}
    if unknown:
        _err(f"compile.components: unknown entries {sorted(unknown)}; known: model, loss")


def _check_checkpoint(cfg: JobConfig) -> None:
    c = cfg.checkpoint
    _one_of("checkpoint.async_mode", c.async_mode, ("disabled", "async", "async_with_pinned_mem"))
    _one_of("checkpoint.export_dtype", c.export_dtype, ("float32", "bfloat16"))
    _one_of("checkpoint.save_on_signal", c.save_on_signal, ("SIGTERM", "SIGUSR1", "none"))
    _positive("checkpoint.interval", c.interval)
    if c.keep_latest_k < 0:
        _err(f"checkpoint.keep_latest_k: must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    if c.load_step < -1:
        _err(f"checkpoint.load_step: must be -1 (newest complete) or a step >= 0, got {c.load_step}")
    unknown = set(c.exclude_from_loading) - {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
    if unknown:
        _err(f"checkpoint.exclude_from_loading: unknown entries {sorted(unknown)}; known: model, optimizer, "
             "lr_scheduler, dataloader, train_state, rng")
    if c.initial_load_in_hf and not c.initial_load_path:
        _err("checkpoint.initial_load_in_hf: needs checkpoint.initial_load_path (the Hugging Face folder)")
    if c.create_seed_checkpoint and not c.enable:
        _err("checkpoint.create_seed_checkpoint: needs checkpoint.enable = true (the seed goes into checkpoint.folder)")


CONVERTERS = ("float8", "lora")
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _check_float8(cfg: JobConfig) -> None:
    converters = cfg.model.converters
    for name in converters:
        _one_of("model.converters", name, CONVERTERS)
    if len(set(converters)) != len(converters):
        _err(f"model.converters: {converters} names a converter twice")
    f8, default = cfg.float8, type(cfg.float8)()
    if "float8" not in converters:
        for key in (f.name for f in dataclasses.fields(f8)):
            if getattr(f8, key) != getattr(default, key):
                _err(f"float8.{key}: set, but model.converters does not include \"float8\"")
        return
    _one_of("float8.recipe_name", f8.recipe_name, FLOAT8_RECIPES)
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        _err(f"float8.enable_fsdp_float8_all_gather: needs recipe_name tensorwise (one scale per weight), "
             f"not {f8.recipe_name}")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        _err("float8.precompute_float8_dynamic_scale_for_fsdp: needs float8.enable_fsdp_float8_all_gather")
    if f8.round_scales_to_power_of_2 and f8.enable_fsdp_float8_all_gather and \
            not f8.precompute_float8_dynamic_scale_for_fsdp:
        _err("float8.round_scales_to_power_of_2: with the float8 all-gather, needs "
             "float8.precompute_float8_dynamic_scale_for_fsdp (torchao's all-gather does not round the scales it "
             "computes itself)")


def _check_profiling(cfg: JobConfig) -> None:
    # The device check (memory snapshots need CUDA) is in tools/profiling.py: it needs the device type.
    p = cfg.profiling
    _positive("profiling.profile_freq", p.profile_freq)
    folder = p.save_traces_folder
    # Traces stay inside job.dump_folder, with the rest of the run's outputs.
    if not folder.strip() or Path(folder).is_absolute() or ".." in Path(folder).parts:
        _err(f"profiling.save_traces_folder: '{folder}' must be a non-empty relative path inside job.dump_folder")
