"""The checks a job passes before any process group exists, in one place for both callers: the launcher runs them
once before torchrun starts any rank (torchtitan/launch.py), and every rank runs them again before
init_distributed (torchtitan/train.py main), for launches that do not go through run_train.sh."""

from __future__ import annotations

from collections.abc import Sequence

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import load_config
from torchtitan.config.resolve import Resolved


def check_job(argv: Sequence[str] | None, world_size: int, *, rl: bool = False) -> tuple[JobConfig, Resolved]:
    """load_config for `world_size` processes plus the checks that need the machine, not a process group.
    `rl`: the caller is the RL entry point (torchtitan/rl/train.py), the only one that accepts rl.enable.
    Raises ConfigError (one line naming the key and, if any, the TOML file)."""
    from torchtitan.tools import device as device_tools
    from torchtitan.tools.profiling import check_profiling_device

    # load_config fills in every derived value (dp_shard, global batch, validation shape) in cfg itself, so the
    # Trainer, the estimator and the saved job_config.json all see the numbers this run uses.
    cfg, resolved = load_config(None if argv is None else list(argv), world_size)
    if cfg.rl.enable != rl:
        raise ConfigError("rl.enable: RL post-training runs through python -m torchtitan.rl.train (docs/rl.md)" if
                          cfg.rl.enable else "rl.enable: false, but this is the RL entry point")
    device_type = device_tools.device_type()
    if cfg.parallelism.enable_async_tensor_parallel and device_type != "cuda":
        raise ConfigError("parallelism.enable_async_tensor_parallel: needs CUDA GPUs (symmetric memory); "
                          f"this machine runs on {device_type}")
    if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: run it on 1 process (NGPU=1), not {world_size}")
    check_profiling_device(cfg.profiling, device_type)
    if "float8" in cfg.model.converters:
        _check_float8(cfg, device_type)
    return cfg, resolved


def _check_float8(cfg: JobConfig, device_type: str) -> None:
    """torchao, the GPU's float8 support and the layer filter, on a meta model of the flavor (ConfigError)."""
    from torchtitan.components.model_parts import model_args_for
    from torchtitan.components.quantization import float8
    from torchtitan.models.registry import get_model_spec

    try:
        float8.check(cfg, get_model_spec(cfg.model.name).model_cls, model_args_for(cfg), device_type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if device_type == "cuda" and not cfg.compile.enable:
        from torchtitan.tools.logging import logger

        logger.warning("float8 without torch.compile (compile.enable false): the casts to float8 run as separate "
                       "kernels and the run is usually slower than bf16; docs/float8.md")


def checked_tokenizer(cfg: JobConfig, model_vocab_size: int):
    """The tokenizer of `model.tokenizer_path` (the default BPE sized to the model), refused when it has more tokens
    than the model's embedding (token ids past the table would fail in the first step, or index another row)."""
    from torchtitan.data.tokenizer import build_tokenizer, default_cache_dir

    tokenizer = build_tokenizer(cfg.model.tokenizer_path, default_cache_dir(), model_vocab_size)
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but "
                          f"{cfg.model.name}/{cfg.model.flavor} has vocab_size {model_vocab_size}")
    return tokenizer


def check_inputs(cfg: JobConfig) -> None:
    """The tokenizer and the data sources, opened as the ranks open them (torchtitan/train.py, validate.py): a
    missing file, a missing text column, an unknown dataset or a tokenizer larger than the model fails here.
    Hub datasets and mixtures are left to the ranks (opening a hub dataset may download it)."""
    from torchtitan.data.datasets import DATASETS, build_document_source
    from torchtitan.data.hf_sources import is_local_path
    from torchtitan.data.tokenizer import default_cache_dir
    from torchtitan.models.registry import get_model_spec

    tokenizer = checked_tokenizer(cfg, get_model_spec(cfg.model.name).flavors[cfg.model.flavor].vocab_size)
    chat = cfg.training.dataset_format != "text"
    if chat:  # the chat template against the tokenizer (its special tokens, a probe conversation)
        from torchtitan.data.chat import ChatEncoder

        ChatEncoder(tokenizer, cfg.training.chat_template, cfg.training.train_on)
    sections = [] if cfg.training.dataset_mixture else [("training", cfg.training)]
    if cfg.validation.enable:
        sections.append(("validation", cfg.validation))
    for prefix, section in sections:
        path, name = section.dataset_path, section.dataset
        if (path and not is_local_path(path, prefix)) or (not path and DATASETS.get(name) is not None):
            continue
        if chat:  # validation's conversations are read in training's format
            from torchtitan.data.chat_source import build_chat_source

            build_chat_source(dataset_path=path, dataset_format=cfg.training.dataset_format,
                              split=section.dataset_split, streaming=section.dataset_streaming,
                              cache_dir=str(default_cache_dir() / "datasets"), key_prefix=prefix, dataset=name)
            continue
        build_document_source(dataset=name, dataset_path=path, text_column=section.dataset_text_column,
                              split=section.dataset_split, streaming=section.dataset_streaming,
                              cache_dir=str(default_cache_dir() / "datasets"), key_prefix=prefix)
