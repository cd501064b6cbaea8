"""Save and resume the whole training state with torch.distributed.checkpoint (DCP).

A full checkpoint `<dump_folder>/<checkpoint.folder>/step-<N>/` holds, under these top-level keys:
  model         every rank's shards of the model (FQN -> tensor/DTensor), `get_model_state_dict`
  optimizer     the optimizers of all model parts, flattened and keyed by FQN (components/optimizer.py)
  lr_scheduler  the scheduler's `state_dict()` (plain data)
  dataloader    the data cursor (plain ints, equal on every rank)
  train_state   {step, tokens_seen}
  rng           {"rank<r>": {"cpu": ..., "cuda": ...}}: each rank's generators under its own key, restored
                only when resuming with the same world size
With `trainable_only` (lora.save_adapter_only) `model` holds the trainable parameters alone (LoRA's adapters; the
optimizer has state for nothing else) and the marker says `trainable_only`: resuming from it loads the base weights
from `initial_load_path` first, then the checkpoint over them.
The last step always writes a full checkpoint, so a finished run can be extended (more training.steps) exactly;
`last_save_model_only` adds the weights alone as an export, `step-<N>-model/` (in `export_dtype`), and
`last_save_in_hf` a Hugging Face folder `step-<N>-hf/`. The seed checkpoint (`step-0`) holds just `model`.
A run never overwrites a complete checkpoint: resuming from a step older than what the folder already holds
is an error before the first step (see `check_continuation`).
Everything besides tensors is plain data, checked before saving and read back with `weights_only=True`.

Completion, retention and the marker format are described in `checkpoint_io`. Saves, loads and their
barriers run on a dedicated gloo process group: a background save's collectives then never interleave
with the training's collectives on the default group, and async saves get the CPU backend DCP requires.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from torchtitan.components import checkpoint_io as cio
from torchtitan.components.checkpoint_io import CheckpointError, checkpoint_step_folders
from torchtitan.components.model_parts import load_model_state_dict, model_state_dict, named_parameters
from torchtitan.components.quantization import lora_export
from torchtitan.config.job_config import Checkpoint
from torchtitan.tools.logging import logger

__all__ = ["ASYNC_MODES", "CheckpointError", "CheckpointManager", "TrainState", "checkpoint_step_folders"]

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainState:
    """Where the run stands: optimizer steps taken and training tokens consumed (global)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    """updates dropped because the loss or gradient was not finite (training.on_nonfinite=skip)"""

    def state_dict(self) -> dict[str, int]:
        return {"step": int(self.step), "tokens_seen": int(self.tokens_seen), "skipped_steps": int(self.skipped_steps)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))  # absent in older checkpoints


class CheckpointManager:
    """Owns `<dump_folder>/<cfg.folder>`: `load()` once after setup, `maybe_save(step)` after every step,
    `close()` before exit. `model_parts` are this rank's parts (one, or its pipeline stages); the optimizer and
    LR scheduler are the containers over them (state_dict / load_state_dict). optimizer, lr_scheduler and
    dataloader may be None (their state is skipped)."""

    def __init__(self, cfg: Checkpoint, *, dump_folder: str | Path, model_parts: list[nn.Module],
                 optimizer: Any, lr_scheduler: Any, dataloader: Any,
                 train_state: TrainState, model_args: Any, world_size: int, rank: int,
                 trainable_only: bool = False) -> None:
        if cfg.async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode: unknown '{cfg.async_mode}'; use one of {', '.join(ASYNC_MODES)}")
        if cfg.export_dtype not in _DTYPES:
            raise ValueError(f"checkpoint.export_dtype: unknown '{cfg.export_dtype}'; use float32 or bfloat16")
        if cfg.enable and cfg.interval <= 0:
            raise ValueError(f"checkpoint.interval must be positive, got {cfg.interval}")
        if cfg.keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k must be >= 0, got {cfg.keep_latest_k}")
        unknown = sorted(set(cfg.exclude_from_loading) - set(cio.STATE_KEYS))
        if unknown:
            raise ValueError(f"checkpoint.exclude_from_loading: unknown '{unknown[0]}'; "
                             f"known: {', '.join(cio.STATE_KEYS)}")
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.model_parts, self.optimizer, self.lr_scheduler = model_parts, optimizer, lr_scheduler
        self.dataloader, self.train_state, self.model_args = dataloader, train_state, model_args
        self.world_size, self.rank = world_size, rank
        self.trainable_only = trainable_only
        distributed = dist.is_available() and dist.is_initialized()
        needed = cfg.enable or bool(cfg.initial_load_path) or cfg.create_seed_checkpoint
        # new_group is collective: every rank builds the manager with the same config, so all agree.
        self._pg = dist.new_group(backend="gloo") if distributed and needed else None
        self._mode = cfg.async_mode
        if self._mode == "async_with_pinned_mem" and not torch.cuda.is_available():
            logger.info("checkpoint.async_mode=async_with_pinned_mem: no CUDA device, nothing to pin; "
                        "saving as 'async'")
            self._mode = "async"
        self._writer: Any = None  # pinned mode: one writer reused, so its pinned staging buffers are allocated once
        # One worker: publishes the marker after a background save, then applies retention. Saves wait for it,
        # so a purge never runs while a save is writing.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None
        self._last_saved: int | None = None

    # ------------------------------------------------------------------ loading
    def load(self) -> bool:
        """Resume from this run's newest (or `load_step`) complete checkpoint, else initialise from
        `initial_load_path`. Returns whether anything was loaded."""
        cfg = self.cfg
        if cfg.enable:
            target = cio.resume_target(self.folder, cfg.load_step)
            if target is not None:
                if (cio.read_marker(target) or {}).get("trainable_only"):
                    if not cfg.initial_load_path:
                        raise CheckpointError(f"checkpoint: {target} holds only the trainable parameters (LoRA "
                                              "adapters): set checkpoint.initial_load_path to the base weights")
                    self._load_initial(Path(cfg.initial_load_path), model_only=True)
                wanted = set(cio.STATE_KEYS) - set(cfg.exclude_from_loading)
                self._load_dcp(target, wanted)
                return True
        if cfg.initial_load_path:
            self._load_initial(Path(cfg.initial_load_path), model_only=cfg.initial_load_model_only)
            return True
        return False

    def _load_initial(self, path: Path, model_only: bool) -> None:
        """The initial weights (and, unless model_only, the state) from checkpoint.initial_load_path."""
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint.initial_load_path: {path} is not a folder")
        if self.cfg.initial_load_in_hf:
            self._load_hf(path)
            return
        if not (path / cio.METADATA).is_file():
            raise FileNotFoundError(f"checkpoint.initial_load_path: {path} has no DCP .metadata (an incomplete "
                                    "save, or a Hugging Face folder: set checkpoint.initial_load_in_hf)")
        if cio.read_marker(path) is None:  # e.g. written by another tool; DCP writes .metadata last
            logger.warning(f"checkpoint.initial_load_path: {path} has no {cio.MARKER} marker; loading it "
                           "because DCP's .metadata (written after every shard) is present")
        self._load_dcp(path, {"model"} if model_only else set(cio.STATE_KEYS) - set(self.cfg.exclude_from_loading))

    def _load_dcp(self, path: Path, wanted: set[str]) -> None:
        t0 = time.perf_counter()
        info = cio.read_marker(path) or {}
        md = cio.read_metadata(path)
        present = {key.split(".", 1)[0] for key in md.state_dict_metadata}
        flat_model = cio.model_prefix(md) == ""  # a model-only folder written by another tool
        state: dict[str, Any] = {}
        if "model" in wanted:
            msd = model_state_dict(self.model_parts)
            # A base model's checkpoint has no LoRA adapters: they keep their initial values (B = 0). A trainable-only
            # one has nothing else: the base weights were loaded from initial_load_path just before.
            prefix = "" if flat_model else "model."
            trainable_only = info.get("trainable_only", False)
            whole = len(msd)
            msd = {k: v for k, v in msd.items()
                   if (not trainable_only and not lora_export.is_adapter(k)) or prefix + k in md.state_dict_metadata}
            # the names left out on purpose keep their values (set_model_state_dict is strict otherwise)
            partial = StateDictOptions(strict=False) if len(msd) < whole else None
            if flat_model:
                state.update(msd)
            else:
                state["model"] = msd
        if "optimizer" in wanted and "optimizer" in present and self.optimizer is not None:
            # Only now: on a fresh optimizer this initialises its state (a zero-LR step).
            state["optimizer"] = self.optimizer.state_dict()
        if "lr_scheduler" in wanted and "lr_scheduler" in present and self.lr_scheduler is not None:
            state["lr_scheduler"] = copy.deepcopy(self.lr_scheduler.state_dict())
        if "dataloader" in wanted and "dataloader" in present and self.dataloader is not None:
            state["dataloader"] = dict(self.dataloader.state_dict())
        if "train_state" in wanted and "train_state" in present:
            # Only the entries this checkpoint has: older ones predate some of TrainState's fields.
            state["train_state"] = {k: v for k, v in self.train_state.state_dict().items()
                                    if f"train_state.{k}" in md.state_dict_metadata}
        if "rng" in wanted and "rng" in present:
            mine = f"rng.rank{self.rank}."
            saved = {k[len(mine):] for k in md.state_dict_metadata if k.startswith(mine)}
            if info.get("world_size") == self.world_size and "cpu" in saved:
                state["rng"] = {f"rank{self.rank}": {k: v for k, v in cio.rng_state().items() if k in saved}}
            else:
                logger.info(f"checkpoint: {path} was saved by {info.get('world_size', '?')} ranks, this run has "
                            f"{self.world_size}: random generators are not restored")
        skipped = [k for k in cio.STATE_KEYS if k != "model" and k not in state]
        try:
            dcp.load(state, checkpoint_id=str(path), planner=cio.SafeLoadPlanner(), process_group=self._pg,
                     no_dist=self._pg is None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"checkpoint: loading {path} failed: {cio.one_line(e)}") from e

        if "model" in wanted:
            load_model_state_dict(self.model_parts, state if flat_model else state["model"], partial)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "dataloader" in state:
            self.dataloader.load_state_dict(state["dataloader"])
        if "train_state" in state:
            self.train_state.load_state_dict(state["train_state"])
        if "rng" in state:
            cio.set_rng_state(state["rng"][f"rank{self.rank}"])
        loaded = [k for k in cio.STATE_KEYS if k in state or (k == "model" and "model" in wanted)]
        logger.info(f"checkpoint: loaded {', '.join(loaded)} from {path} (step {self.train_state.step}) "
                    f"in {time.perf_counter() - t0:.2f}s")
        if skipped:
            logger.info(f"checkpoint: not restored (excluded or not in the checkpoint): {', '.join(skipped)}")

    def _load_hf(self, path: Path) -> None:
        from torchtitan.components.hf_sharded import load_hf_sharded

        t0 = time.perf_counter()
        # By shard (hf_sharded.py): every rank copies only its own rows out of the files, whatever the layout
        # (pipeline stages included); no rank ever holds the model. The only collective is the error report.
        try:  # a failure on any rank raises on all (one all_gather_object on self._pg)
            load_hf_sharded(path, self.model_parts, self.model_args, pg=self._pg)
        except (RuntimeError, ValueError, OSError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint.initial_load_path: cannot load Hugging Face folder {path}: "
                                  f"{cio.one_line(e)}") from e
        logger.info(f"checkpoint: loaded model weights from Hugging Face folder {path} "
                    f"in {time.perf_counter() - t0:.2f}s")

    def check_continuation(self, total_steps: int) -> None:
        """After load(): fail before the first step if continuing would overwrite a checkpoint of the folder
        (an earlier run got further than the step resumed from) or if training.steps is already behind."""
        step = self.train_state.step
        if step > total_steps:
            raise ValueError(f"training.steps={total_steps} is below step {step}, where the resumed checkpoint "
                             f"in {self.folder} stands: set training.steps > {step} to train on")
        if step == total_steps and step > 0:
            logger.info(f"checkpoint: the run already stands at training.steps={total_steps}: nothing to train "
                        "(raise training.steps to extend it)")
        if not self.cfg.enable:
            return
        later = [p.name for k, p in cio.saved_step_folders(self.folder) if k > step]
        if later:
            raise ValueError(
                f"checkpoint: {self.folder} already holds {', '.join(later)} from a run that got further than step "
                f"{step}, where this run resumes; continuing would overwrite them: move them away (or use another "
                "job.dump_folder) to retrain from here, or resume from the newest (checkpoint.load_step = -1)")

    # ------------------------------------------------------------------ saving
    def maybe_save(self, step: int, *, last_step: bool = False, force: bool = False) -> None:
        """Save if this step is due (interval, first step, last step) or `force`d (e.g. on SIGTERM); after the
        last step also write the exports (model-only, Hugging Face) the config asks for.

        With async_mode, returns once the state is staged; the files are written in the background.
        """
        cfg = self.cfg
        if not cfg.enable:
            return
        due = force or last_step or step % cfg.interval == 0 or (step == 1 and cfg.enable_first_step_checkpoint)
        if due and step != self._last_saved:
            # Always the full state, the last step included: extending a finished run continues exactly.
            self._save(step, model_only=False)
        if last_step and cfg.last_save_model_only:
            self._save(step, model_only=True, dtype=cfg.export_dtype, name=f"step-{step}-model")
        if last_step and cfg.last_save_in_hf:
            self._export_hf(step)

    def save_seed_checkpoint(self) -> None:
        """`step-0` with the freshly initialised model only, written by a 1-process run."""
        if self.world_size != 1:
            raise ValueError("checkpoint.create_seed_checkpoint: run it on 1 process "
                             f"(world size is {self.world_size})")
        self._save(0, model_only=True, dtype=None)
        self.wait()

    def _save(self, step: int, *, model_only: bool, dtype: str | None = None, name: str | None = None) -> None:
        self.wait()  # one save at a time: the previous one is published (and purged) before this one starts
        path = self.folder / (name or f"step-{step}")

        t0 = time.perf_counter()
        state = self._model_state(dtype) if model_only else self._full_state()
        needed = self._bytes_to_write(state)

        def prepare() -> None:
            if cio.read_marker(path) is not None:
                raise CheckpointError(f"{path} is a complete checkpoint; a run never overwrites one")
            if path.exists():
                logger.info(f"checkpoint: replacing the incomplete {path}")
                cio.remove_checkpoint(path)
            cio.check_free_space(self.folder, needed)
            path.mkdir(parents=True, exist_ok=True)

        # Nobody writes into the folder before rank 0 cleared a leftover of the same name and found room for the
        # whole checkpoint (the broadcast is the barrier), and every rank raises if rank 0 refused.
        self._on_rank0(prepare, f"checkpoint: cannot save step {step}")
        info = {"step": step, "world_size": self.world_size, "model_only": model_only,
                "dtype": dtype, "torch": torch.__version__, "trainable_only": self.trainable_only and not model_only}
        self._last_saved = step
        if self._mode != "disabled" and not model_only:
            upload = self._start_async(state, path)
            self._pending = self._executor.submit(self._finish_async, upload, path, info, t0)
            logger.info(f"checkpoint: step {step} staged in {time.perf_counter() - t0:.2f}s; writing {path} "
                        "in the background")
            return
        # Model-only saves are the seed and the final save: the process exits right after, so they are
        # written synchronously even in async mode.
        try:
            dcp.save(state, checkpoint_id=str(path), process_group=self._pg, no_dist=self._pg is None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            # DCP raises on every rank only after gathering every rank's write result: nobody writes any more.
            self._remove_partial(path)
            raise CheckpointError(f"checkpoint: saving {path} failed: {cio.one_line(e)}") from e
        self._barrier()  # every rank's dcp.save has returned: all shards and the .metadata are on disk
        self._on_rank0(lambda: self._publish(path, info, t0), f"checkpoint: cannot publish {path}")
        if self.rank == 0:
            self._pending = self._executor.submit(self._purge, path)

    def _full_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": model_state_dict(self.model_parts)}
        if self.trainable_only:  # every rank keeps what it trains (pipeline stages hold different names)
            trainable = {name for name, p in named_parameters(self.model_parts) if p.requires_grad}
            state["model"] = {k: v for k, v in state["model"].items() if k in trainable}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.lr_scheduler is not None:
            # A copy: training mutates the scheduler while a background save is still reading its state.
            state["lr_scheduler"] = copy.deepcopy(self.lr_scheduler.state_dict())
        if self.dataloader is not None:
            state["dataloader"] = dict(self.dataloader.state_dict())
        state["train_state"] = self.train_state.state_dict()
        state["rng"] = {f"rank{self.rank}": cio.rng_state()}
        for key in ("optimizer", "lr_scheduler", "dataloader", "train_state"):
            if key in state:
                cio.check_plain(state[key], key)
        return state

    def _model_state(self, dtype: str | None) -> dict[str, Any]:
        sd = model_state_dict(self.model_parts)
        if dtype is not None:
            sd = {k: v.detach().to(_DTYPES[dtype]) for k, v in sd.items()}
        return {"model": sd}

    def _start_async(self, state: dict[str, Any], path: Path) -> Future:
        kwargs: dict[str, Any] = {}
        if self._mode == "async_with_pinned_mem":
            # FileSystemWriter is itself DCP's stager: with cache_staged_state_dict it copies the state into
            # pinned CPU buffers allocated on the first save and reused afterwards (fast D2H copies).
            if self._writer is None:
                self._writer = dcp.FileSystemWriter(str(path), cache_staged_state_dict=True)
            kwargs["storage_writer"] = self._writer
        # No no_dist here (not in every supported torch): without a process group DCP infers it.
        response = dcp.async_save(state, checkpoint_id=str(path), process_group=self._pg, **kwargs)
        # torch >= 2.9 may return an AsyncSaveResponse (staging + upload futures) with custom stagers.
        return getattr(response, "upload_completion", response)

    def _finish_async(self, upload: Future, path: Path, info: dict[str, Any], t0: float) -> None:
        # Runs on the checkpoint thread, never on the training thread.
        try:
            upload.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            self._remove_partial(path)
            message = f"checkpoint: background save of {path} failed: {cio.one_line(e)}"
            logger.error(message)  # now, on the checkpoint thread; wait() re-raises it on the training thread
            raise CheckpointError(message) from e
        if self.rank == 0:
            # Rank 0's DCP save returns only after it gathered every rank's write results and wrote
            # .metadata, so every shard is on disk here: the marker goes last.
            self._publish(path, info, t0)
            self._purge(path)

    def _bytes_to_write(self, state: dict[str, Any]) -> int:
        """Bytes the whole checkpoint of `state` puts on disk, every tensor counted once: DCP writes one copy of a
        replicated tensor. A DTensor's shard counts on the ranks at coordinate 0 of every mesh dimension that
        does not shard it; a plain tensor (a DDP replica, a pipeline stage's, a rank's RNG state) once per key.
        Equal on every rank: one all_gather_object on the checkpoint group."""
        sharded, plain = cio.tensor_bytes(state)
        if self._pg is None:
            return sharded + sum(plain.values())
        parts: list[Any] = [None] * dist.get_world_size(self._pg)
        dist.all_gather_object(parts, (sharded, plain), group=self._pg)
        unique: dict[str, int] = {}
        for _, rank_plain in parts:
            unique.update(rank_plain)
        return sum(part[0] for part in parts) + sum(unique.values())

    def _remove_partial(self, path: Path) -> None:
        """After a failed save: rank 0 deletes what was written, unless the folder is complete (never the case
        for a save that failed before its marker, but a marker is the one proof the rule keeps)."""
        if self.rank != 0 or cio.read_marker(path) is not None:
            return
        try:
            cio.remove_checkpoint(path)
            logger.info(f"checkpoint: removed the partial {path}")
        except OSError as e:
            logger.warning(f"checkpoint: could not remove the partial {path}: {cio.one_line(e)}")

    def _publish(self, path: Path, info: dict[str, Any], t0: float) -> None:
        cio.write_marker(path, {**info, "time": time.time()})
        kind = f"model-only ({info['dtype'] or 'as trained'})" if info["model_only"] else "full"
        logger.info(f"checkpoint: saved {kind} {path} in {time.perf_counter() - t0:.2f}s")

    def _purge(self, just_saved: Path) -> None:
        try:
            cio.purge(self.folder, self.cfg.keep_latest_k, keep=just_saved)
        except Exception as e:  # retention must never stop training
            logger.warning(f"checkpoint: retention (checkpoint.keep_latest_k) failed: {cio.one_line(e)}")

    def _export_hf(self, step: int) -> None:
        from torchtitan.components.hf_sharded import save_hf_sharded

        self.wait()  # the export's collectives must not interleave with a background save on self._pg
        t0 = time.perf_counter()
        out = self.folder / f"step-{step}-hf"
        # By shard (hf_sharded.py): every rank writes its own rows into files rank 0 laid out; no rank ever holds
        # the model, with or without pipeline parallel. Collective over every rank (on self._pg).
        # The run's tokenizer (the one its data loader encodes with) makes the folder self-contained: tokenizer files
        # and BOS/EOS ids, exactly as scripts/convert_checkpoint.py dcp-to-hf writes them.
        # Chat data (torchtitan/data/chat_loader.py): the tokenizer under its encoder and the template it rendered.
        tokenizer = getattr(self.dataloader, "text_tokenizer", None) or getattr(self.dataloader, "tokenizer", None)
        chat_template = getattr(self.dataloader, "chat_template", None)
        if tokenizer is None and self.rank == 0:
            logger.info("checkpoint.last_save_in_hf: no tokenizer known to the checkpointer; the Hugging Face folder "
                        "gets no tokenizer files and no BOS/EOS ids")
        # LoRA (torchtitan/components/quantization/lora_export.py): the folder holds the merged weights, and the
        # adapters alone go to step-<N>-peft in PEFT's format.
        lora = bool(lora_export.lora_modules(self.model_parts))
        try:
            state = lora_export.merged_state_dict(self.model_parts) if lora else model_state_dict(self.model_parts)
            save_hf_sharded(out, state, self.model_args, dtype=self.cfg.export_dtype, pg=self._pg, tokenizer=tokenizer,
                            chat_template=chat_template)
            if lora:
                base = self.cfg.initial_load_path if self.cfg.initial_load_in_hf else ""
                lora_export.save_peft(self.folder / f"step-{step}-peft", self.model_parts, self.model_args,
                                      base_model_name_or_path=base, pg=self._pg)
        except (RuntimeError, ValueError, OSError) as e:  # raised alike on every rank
            raise CheckpointError(f"checkpoint.last_save_in_hf: cannot write {out}: {cio.one_line(e)}") from e
        logger.info(f"checkpoint: exported Hugging Face folder {out} in {time.perf_counter() - t0:.2f}s")

    # ------------------------------------------------------------------ plumbing
    def wait(self) -> None:
        """Block until the pending save (if any) is written and published; re-raises its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            close = getattr(self._writer, "close", None)
            if close is not None:
                close()

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The checkpoint's own group. It keeps torch's default timeout (30 minutes on gloo) when the training
        groups get comm.train_timeout_seconds: a save legitimately waits on the filesystem."""
        return self._pg

    # Every collective on the checkpoint group from the training thread runs here, after `wait()`: a background
    # save talks on the same group from another thread, and two users of one group at once hang or crash gloo.
    def _barrier(self) -> None:
        self.wait()
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _on_rank0(self, fn: Callable[[], object], what: str) -> None:
        """Run `fn` on rank 0 and raise the same one-line error on every rank if it failed there, instead of
        leaving the others waiting in their next collective."""
        self.wait()
        error = None
        if self.rank == 0:
            try:
                fn()
            except CheckpointError as e:  # our own message: it names the folder already
                error = f"{what}: {e}"
            except Exception as e:
                error = f"{what}: {cio.one_line(e)}"
        if self._pg is not None:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self._pg)
            error = box[0]
        if error is not None:
            raise CheckpointError(error)
