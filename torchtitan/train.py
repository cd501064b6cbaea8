"""Entry point and Trainer: set up once, then the loop and the step. Nothing else lives here."""

from __future__ import annotations

from torchtitan.tools import startup_gc

# A rank's own process (python -m torchtitan.train): collection is paused for the imports below, and main() freezes
# what they built (torchtitan/tools/startup_gc.py). Imported as a module, nothing changes.
if __name__ == "__main__":
    startup_gc.pause()

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torchtitan.components import startup
from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.components.checkpoint_io import CheckpointError, one_line
from torchtitan.components.loss import count_target_tokens, cross_entropy_sum
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.metrics import MetricsLogger
from torchtitan.components.model_parts import build_model_parts, materialize, model_args_for
from torchtitan.components.moe_balance import (
    CollapseWatch,
    configure_balance_losses,
    moe_layers,
    update_expert_biases,
)
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.quantization import float8
from torchtitan.components.step import forward_backward_step, scheduled_garbage_collection
from torchtitan.components.step_guard import StepGuard, TrainingError
from torchtitan.components.validate import Validator
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_dict
from torchtitan.config.preflight import check_job, checked_tokenizer
from torchtitan.config.resolve import Resolved
from torchtitan.data.chat_loader import build_sft_dataloader
from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.datasets import build_document_source
from torchtitan.data.mixture import build_mixture_dataloader
from torchtitan.data.tokenizer import default_cache_dir
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.compile import compile_loss
from torchtitan.distributed.context_parallel import shard_microbatches
from torchtitan.distributed.pipeline_parallel import Pipeline
from torchtitan.distributed.preemption import PreemptionFlag
from torchtitan.models.registry import get_model_spec
from torchtitan.tools import device as device_tools
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.profiling import maybe_profile

COMM_TRACES = "comm_traces"
"""Folder inside job.dump_folder where flight-recorder dumps go after a failed or timed-out collective"""


def data_workers(num_workers: int, device_type: str) -> int:
    """training.num_workers, with -1 resolved: 2 per rank on a GPU, whose step must never wait on tokenizing (on the
    8B-shaped GPU run, tokenizing in line stalled 4-6 of 20 steps by 7-28%, 2 workers none: docs/data.md); none on
    CPU, whose ranks already use the cores."""
    if num_workers != -1:
        return num_workers
    return 2 if device_type == "cuda" else 0


class Trainer:
    def __init__(self, cfg: JobConfig, resolved: Resolved, device: torch.device):
        """`cfg` and `resolved` come from load_config, `device` and the default process group from
        init_distributed (run() below); the parity tests build several Trainers, one layout after another, inside
        one persistent group of processes."""
        self.started_at = time.monotonic()  # the console's elapsed time (components/metrics.py's clock)
        self.startup = startup.StartupClock()  # the start-up line logged after step 1
        parallel_dims, grad_accum_steps = resolved.parallel_dims, resolved.grad_accum_steps
        self.cfg, self.parallel_dims, self.grad_accum_steps = cfg, parallel_dims, grad_accum_steps
        self.rank = dist_utils.env_world()[0]
        self.device = device
        parallel_dims.build_mesh(self.device.type)
        self.loss_mesh = parallel_dims.mesh("dp_cp")
        self.token_mesh = parallel_dims.token_mesh()  # MoE routing counts: dp x cp, and tp, which splits their tokens
        self.cp_mesh = parallel_dims.mesh("cp") if parallel_dims.cp > 1 else None
        seed = 0 if cfg.debug.seed is None else cfg.debug.seed
        dist_utils.set_determinism(seed, cfg.debug.deterministic)
        self.tf32 = device_tools.set_tf32(cfg.training.tf32, self.device.type)
        if self.device.type == "cpu":  # CPU training only: see each function for what it measured
            device_tools.flush_cpu_denormals()
            device_tools.keep_freed_host_memory()
        cfg.training.num_workers = data_workers(cfg.training.num_workers, self.device.type)  # job_config.json's
        self.dump_folder = Path(cfg.job.dump_folder)
        self._save_config()

        # Tokenizer and data are checked before the model is built: a bad path fails in seconds.
        spec = get_model_spec(cfg.model.name)
        model_args = model_args_for(cfg)
        tokenizer = checked_tokenizer(cfg, model_args.vocab_size)
        dp_mesh = parallel_dims.mesh("dp")
        t = cfg.training
        source_args = dict(text_column=t.dataset_text_column, split=t.dataset_split, streaming=t.dataset_streaming,
                           cache_dir=str(default_cache_dir() / "datasets"))
        loader_args = dict(tokenizer=tokenizer, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
                           dp_rank=dp_mesh.get_local_rank(), dp_degree=dp_mesh.size(), num_workers=t.num_workers,
                           document_masking=cfg.model.attn_mask_type == "block_causal")
        source = None
        if t.dataset_mixture:  # several weighted sources: docs/data.md, "Dataset mixtures"
            self.dataloader = build_mixture_dataloader(entries=t.dataset_mixture, source_args=source_args,
                                                       **loader_args)
        elif t.dataset_format != "text":  # conversations for supervised fine-tuning: docs/finetuning.md
            source, self.dataloader = build_sft_dataloader(t, source_args, loader_args)
        else:
            source = build_document_source(dataset=t.dataset, dataset_path=t.dataset_path, key_prefix="training",
                                           **source_args)
            self.dataloader = build_dataloader(source=source, **loader_args)
        self.loss_parallel = parallel_dims.loss_parallel_enabled(cfg.parallelism.disable_loss_parallel)
        # Measured (torch 2.13, CPU): a TP block compiled for training fails when recompiled under no_grad
        # ("'Tensor' object has no attribute 'elem'", an async-collective input). Validation runs it eagerly.
        validate_eager = parallel_dims.tp_enabled and cfg.compile.enable and "model" in cfg.compile.components
        self.validator = None
        self.pp_mesh = parallel_dims.mesh("pp") if resolved.pipeline is not None else None
        if cfg.validation.enable:
            self.validator = Validator(cfg, tokenizer, dp_mesh.get_local_rank(), dp_mesh.size(), self.loss_mesh,
                                       self.device, str(default_cache_dir() / "datasets"),
                                       loss_parallel=self.loss_parallel, eager=validate_eager,
                                       pp_mesh=self.pp_mesh, cp_mesh=self.cp_mesh)

        self.startup.mark("mesh, tokenizer and data")
        # Build on meta, cut into this rank's pipeline stages, parallelize, then materialise: no rank ever holds
        # the full unsharded model. The memory estimator builds through the same function.
        with torch.device("meta"):
            whole = spec.model_cls(model_args)
        self.nparams, self.flops_per_token = spec.nparams_and_flops_fn(whole, model_args, cfg.training.seq_len)
        param_order = {name: i for i, (name, _) in enumerate(whole.named_parameters())}
        del whole
        param_dtype = device_tools.training_param_dtype(cfg.training.mixed_precision_param, self.device.type)
        if param_dtype != cfg.training.mixed_precision_param:
            logger.info("CPU run: training in float32 (training.mixed_precision_param applies on GPU)")
        self.model_parts = build_model_parts(cfg, parallel_dims, resolved.pipeline, param_dtype, model_args)
        self.startup.mark("model build and parallelize")
        materialize(self.model_parts, self.device, seed, dist_utils.param_init)
        self.startup.mark("init")
        if cfg.compile.enable and "loss" in cfg.compile.components:
            if self.loss_parallel:
                # Measured (torch 2.13): a compiled loss does not see loss_parallel's op handlers and returns a
                # wrong loss on vocab-sharded logits, silently. Keep the loss eager there.
                logger.info("compile: the loss stays eager under loss parallel")
            else:  # the output projection's cross-entropy of each chunk (torchtitan/models/decoder.py)
                for part in self.model_parts:
                    if getattr(part, "output", None) is not None:
                        part.output.loss_fn = compile_loss(cross_entropy_sum, cfg.compile.backend)
        self.autocast = dist_utils.mixed_precision_autocast(parallel_dims, param_dtype, self.device.type)
        self.pipeline = None
        if resolved.pipeline is not None:
            self.pipeline = Pipeline(resolved.pipeline, self.model_parts, self.pp_mesh, self.device,
                                     cfg.training.local_batch_size)

        self.optimizer = OptimizersContainer(self.model_parts, cfg.optimizer, self.device.type)
        self.after_optimizer_step = float8.post_optimizer_step(cfg, self.model_parts)
        # Every rank of an MoE model balances (a pipeline rank whose stages hold no MoE layer still joins the load
        # metric's reduction over pp), so the decision comes from the model args, the same on every rank.
        self.moe_args = getattr(model_args, "moe", None)
        self.moe_layers = moe_layers(self.model_parts) if self.moe_args is not None else None
        if self.moe_layers:
            configure_balance_losses(self.moe_layers, parallel_dims, cfg.training.global_batch_size,
                                     cfg.training.seq_len)
        self.collapse_watch = None if self.moe_args is None else CollapseWatch(
            self.moe_args, cfg.moe.collapse_load_fraction, cfg.moe.collapse_warn_after_steps,
            cfg.moe.collapse_warn_every_steps)
        self.moe_metrics: dict[str, float] = {}
        self.moe_counts: dict[str, torch.Tensor] = {}  # tokens per expert of each local MoE layer, last step
        self.lr_scheduler = LRSchedulersContainer(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.memory = device_tools.MemoryMonitor(self.device.type)
        self.peak_flops = device_tools.mfu_peak_flops(self.device.type, param_dtype, tf32=self.tf32)
        # Resume (or initial weights) last: everything a checkpoint restores must exist first.
        self.train_state = TrainState()
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, dump_folder=self.dump_folder, model_parts=self.model_parts, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, train_state=self.train_state,
            model_args=model_args, world_size=parallel_dims.world_size, rank=self.rank,
            trainable_only=cfg.lora.save_adapter_only,
        )
        self.startup.mark("optimizer and the rest")
        if not cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.load()
            self.checkpointer.check_continuation(cfg.training.steps)
        self.startup.mark("checkpoint load")
        self.first_step = self.train_state.step + 1
        # After the checkpoint: whether this run resumes decides if metrics.jsonl is continued or started anew.
        self.metrics = MetricsLogger(
            dump_folder=self.dump_folder,
            rank=self.rank,
            total_steps=cfg.training.steps,
            enable_tensorboard=cfg.metrics.enable_tensorboard,
            save_tb_folder=cfg.metrics.save_tb_folder,
            enable_wandb=cfg.metrics.enable_wandb,
            save_for_all_ranks=cfg.metrics.save_for_all_ranks,
            run_config=to_dict(cfg),
            resumed_after=self.train_state.step,
            started_at=self.started_at,
        )
        self.stop_signal = PreemptionFlag(cfg.checkpoint.save_on_signal if cfg.checkpoint.enable else "none",
                                          grace_s=cfg.comm.train_timeout_seconds)
        self.guard = StepGuard(cfg.training.on_nonfinite, self.model_parts, self.stop_signal, self.device,
                               self.train_state, param_order)
        logger.info(f"model {cfg.model.name}/{cfg.model.flavor}: {self.nparams:,} parameters, "
                    f"{self.flops_per_token / 1e9:.3f} GFLOPs/token")
        logger.info(startup.layout_line(parallel_dims, self.loss_parallel, self.pipeline, t.local_batch_size))
        logger.info(startup.training_line(cfg, parallel_dims, grad_accum_steps, param_dtype, self.device))
        logger.info(startup.data_line(cfg, source))

    def _save_config(self) -> None:
        if self.rank != 0:
            return
        text = json.dumps(to_dict(self.cfg), indent=2)
        if self.cfg.job.print_config:
            logger.info(f"{self.cfg.job.description}; resolved config:\n{text}")
        else:
            logger.info(self.cfg.job.description)
        if self.cfg.job.save_config_file:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / self.cfg.job.save_config_file).write_text(text + "\n")

    def train_step(self, step: int, microbatches: list[dict[str, torch.Tensor]]):
        """Forward/backward every micro-batch, check, clip, step. Returns (local loss sum, local tokens, global
        tokens, grad norm)."""
        # Context parallel: this rank's share of every sequence (torchtitan/distributed/context_parallel.py).
        microbatches = shard_microbatches(microbatches, self.cp_mesh)
        # Counted on the host (labels arrive there) so logging never waits on the device for it.
        local_tokens = sum(count_target_tokens(batch["labels"]) for batch in microbatches)
        global_tokens = dist_utils.all_reduce(local_tokens.to(self.device), self.loss_mesh, "sum")
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the LR this step uses, for the log
        self.guard.step = step
        local_loss_sum, grad_norm = forward_backward_step(
            self.model_parts, self.optimizer, microbatches, global_tokens,
            max_norm=self.cfg.training.max_norm, device=self.device, autocast=self.autocast,
            loss_parallel=self.loss_parallel, pipeline=self.pipeline, pp_mesh=self.pp_mesh,
            should_step=self.guard.should_step, after_optimizer_step=self.after_optimizer_step,
        )
        if self.moe_layers is not None:  # auxiliary-loss-free balancing, from this step's global expert load
            self.moe_metrics, self.moe_counts = update_expert_biases(self.moe_layers, self.token_mesh, self.pp_mesh,
                                                                     self.device, self.moe_args)
            self.collapse_watch.observe(step, self.moe_metrics)
        self.lr_scheduler.step()
        return local_loss_sum, local_tokens, global_tokens, grad_norm

    def train(self, after_step: Callable[[int], None] | None = None) -> None:
        """Train until training.steps (or an agreed stop signal). `after_step(step)` runs after each step's
        update and log, before its checkpoint (the parity tests read the parameters there)."""
        with scheduled_garbage_collection():  # collected on a fixed cadence, not at random points inside a step
            if self.after_optimizer_step is not None:  # float8: the first all-gather's scales, as every later one's
                self.after_optimizer_step()
            try:
                with maybe_profile(self.cfg.profiling, self.dump_folder, self.rank, self.device.type,
                                   self.first_step, self.cfg.training.steps) as profiler:
                    self._loop(after_step, profiler)
            finally:
                self.stop_signal.acknowledge()  # finishing or failing, not stuck: no watchdog exit

    def _loop(self, after_step, profiler) -> None:
        cfg = self.cfg.training
        data_iter = iter(self.dataloader)
        window_start, data_wait, window_tokens = time.perf_counter(), 0.0, 0
        self.memory.reset_peak()
        for step in range(self.train_state.step + 1, cfg.steps + 1):
            t = time.perf_counter()
            microbatches = [next(data_iter) for _ in range(self.grad_accum_steps)]
            data_wait += time.perf_counter() - t
            loss_sum, local_tokens, global_tokens, grad_norm = self._guarded_step(step, microbatches)
            self.train_state.step = step
            self.train_state.tokens_seen += int(global_tokens)
            window_tokens += int(local_tokens)
            if step == self.first_step:  # compilation and first collectives are behind us
                self.startup.mark("step 1 (compile, first collectives)")
                logger.info(self.startup.line())
                dist_utils.set_training_timeout(self.cfg.comm.train_timeout_seconds,
                                                keep=[self.checkpointer.process_group])
            if step % cfg.gc_freq == 0:
                gc.collect(1)
                if self.device.type == "cpu":
                    device_tools.release_freed_host_memory()
            validation = {}
            if self.validator is not None and (step % self.cfg.validation.freq == 0 or step == cfg.steps):
                validation = self.validator.validate(self.model_parts, self.autocast, self.pipeline)
            if step == self.first_step or step % self.cfg.metrics.log_freq == 0 or step == cfg.steps or validation:
                elapsed = time.perf_counter() - window_start
                # Per device: the tp x cp x pp ranks of one data-parallel rank share its tokens.
                tps = window_tokens / elapsed / self.parallel_dims.same_tokens_size
                self._log(step, loss_sum, local_tokens, global_tokens, grad_norm, tps, 100.0 * data_wait / elapsed,
                          validation)
                window_start, data_wait, window_tokens = time.perf_counter(), 0.0, 0
                self.memory.reset_peak()
            if after_step is not None:
                after_step(step)
            stop = self.guard.stop_requested
            if stop:
                self.stop_signal.acknowledge()
            self.checkpointer.maybe_save(step, last_step=step == cfg.steps, force=stop)
            profiler.step()
            if stop:
                logger.info(f"{self.stop_signal.name} received: checkpoint saved after step {step}; exiting")
                return
        logger.info(f"training finished after {cfg.steps} steps")

    def _guarded_step(self, step: int, microbatches):
        """train_step, with any failure named by its step; after a failed collective this rank's flight
        recorder (comm.trace_buf_size) is written to <dump_folder>/comm_traces for diagnosis."""
        try:
            return self.train_step(step, microbatches)
        except TrainingError:
            raise
        except Exception as e:
            traces = dist_utils.dump_comm_traces(self.dump_folder / COMM_TRACES, self.rank)
            where = f"; collective traces in {traces}" if traces else ""
            raise TrainingError(f"step {step} failed: {one_line(e)}{where}") from e

    def _log(self, step, loss_sum, local_tokens, global_tokens, grad_norm, tps: float, data_pct: float,
             validation: dict[str, float]) -> None:
        # With pipeline parallel the loss lives on the last stage's ranks (zero elsewhere): summing over pp brings
        # it to rank 0, which writes the metrics.
        loss_sum = dist_utils.all_reduce(loss_sum, self.pp_mesh, "sum")
        loss = dist_utils.all_reduce(loss_sum, self.loss_mesh, "sum") / global_tokens
        loss_max = dist_utils.all_reduce(loss_sum / local_tokens.to(self.device), self.loss_mesh, "max")
        tflops = self.flops_per_token * tps / 1e12
        self.metrics.log(step, {
            "loss": loss.item(),
            "loss_max": loss_max.item(),
            "grad_norm": grad_norm.item(),
            "lr": self.step_lr,
            "tps": round(tps, 1),
            "tflops": round(tflops, 3),
            "mfu": None if self.peak_flops is None else round(100.0 * tflops * 1e12 / self.peak_flops, 2),
            "data_wait_pct": round(data_pct, 2),
            "tokens_seen": self.train_state.tokens_seen,
            "skipped_steps": self.train_state.skipped_steps,
            **self.memory.snapshot(),
            **self.moe_metrics,
            **getattr(self.dataloader, "mixture_metrics", dict)(),  # data/mix/<source>: realised fractions
            **validation,
        })
        # TensorBoard only: tokens per expert of each MoE layer on this rank (rank 0 writes: under pipeline
        # parallel, the first stage's layers).
        self.metrics.log_histograms(step, {f"moe_tokens_per_expert/{name}": c for name, c in self.moe_counts.items()})

    def close(self) -> None:
        self.checkpointer.close()  # waits for an async save to complete (its marker is written last)
        self.metrics.close()
        self.dataloader.close()


def _estimate_and_exit(cfg: JobConfig, rank: int, world_size: int) -> None:
    """memory_estimation.enable: rank 0 estimates this layout (fake tensors, no process group) and gives the verdict
    against this machine's device (or memory_estimation.device_memory_gib); exit code 0 fits, 3 does not (as
    scripts/estimate_memory.sh, which also suggests the changes that would fit)."""
    code = 0
    if rank == 0:
        from torchtitan.estimation.advice import exit_code
        from torchtitan.estimation.engine import estimate
        from torchtitan.estimation.report import DEFAULT_GPU_RESERVE_GIB, fits, needed_gib

        device_type = device_tools.device_type()
        est = estimate(cfg, world_size, 0, device_type)
        logger.info(f"memory estimate for rank 0 of {world_size}: peak {est.peak_bytes / 2**30:.2f} GiB during "
                    f"{est.peak_phase}; " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in est.breakdown.items()))
        capacity, reserve = cfg.memory_estimation.device_memory_gib, 0.0
        if device_type == "cuda":
            capacity = capacity or torch.cuda.get_device_properties(0).total_memory / 2**30
            reserve = DEFAULT_GPU_RESERVE_GIB  # the allocator's cache and the CUDA context, outside tensors
        elif not capacity:  # the node's ranks share the host's memory
            capacity = device_tools.host_memory_bytes() / 2**30 / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        fit = fits(est.peak_bytes, capacity, reserve)
        verdict = (f"memory estimate: {'FITS' if fit else 'DOES NOT FIT'} in {capacity:.2f} GiB per device "
                   f"(reserve {reserve:.1f} GiB): headroom {capacity - needed_gib(est.peak_bytes, reserve):.2f} GiB")
        if not fit:
            verdict += "; scripts/estimate_memory.sh with the same config suggests changes that fit"
            dist_utils.record_failure(ValueError(verdict))
        print(verdict, file=sys.stderr)
        code = exit_code(fit)
    dist_utils.exit_process(code)


def main(argv: list[str] | None = None) -> None:
    startup_gc.freeze_and_resume()
    init_logger()
    rank, _, world_size = dist_utils.env_world()
    try:
        # Everything that can be checked without a process group is checked here, before one exists (the launcher
        # ran the same checks before starting the ranks; a run started another way gets them here).
        cfg, resolved = check_job(argv, world_size)
    except ConfigError as e:
        # Every rank reports (torchrun shows LOG_RANK's output) and records the error for the launcher's
        # summary: whichever rank exits first gets the others killed, possibly before they print.
        print(f"config error: {e}", file=sys.stderr)
        dist_utils.record_failure(e)
        dist_utils.exit_process(2)
    if cfg.memory_estimation.enable:
        _estimate_and_exit(cfg, rank, world_size)
    dist_utils.exit_process(run(cfg, resolved))


def run(cfg: JobConfig, resolved: Resolved) -> int:
    """Create the process group, set up, train, close. Returns the exit code: 0 done, 1 failed, 2 bad setup."""
    rank = dist_utils.env_world()[0]
    try:
        device = dist_utils.init_distributed(cfg.comm.init_timeout_seconds, cfg.comm.trace_buf_size,
                                             Path(cfg.job.dump_folder) / COMM_TRACES)
        trainer = Trainer(cfg, resolved, device)
    except (ValueError, FileNotFoundError) as e:
        # Setup errors (tokenizer, data, vocab, checkpoint folder) name their key or file: one line, no traceback.
        print(f"[rank{rank}] error: {e}", file=sys.stderr)
        dist_utils.record_failure(e)
        return 2
    except BaseException as e:  # noqa: BLE001 - any failure must reach the launcher as a non-zero exit
        if dist_utils.lost_a_peer(e):  # another rank failed first: the launcher names it
            print(f"[rank{rank}] error: setup failed: {one_line(e)}", file=sys.stderr)
        else:
            logger.exception(f"rank {rank}: setup failed")
        dist_utils.record_failure(e)
        return 1
    try:
        if cfg.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save_seed_checkpoint()
        else:
            trainer.train()
        trainer.close()
    except CheckpointError as e:  # a full disk, a failed write: the message names the folder and the cause
        print(f"[rank{rank}] error: {e}", file=sys.stderr)
        dist_utils.record_failure(e)
        return 1
    except TrainingError as e:
        # A step failed on an exception: its traceback is the evidence, unless it only says a peer rank went away.
        if e.__cause__ is not None and not dist_utils.lost_a_peer(e.__cause__):
            logger.error(f"rank {rank}: traceback of the failure", exc_info=e.__cause__)
        print(f"[rank{rank}] error: {e}", file=sys.stderr)
        dist_utils.record_failure(e)
        return 1
    except BaseException as e:  # noqa: BLE001
        logger.exception(f"rank {rank}: training failed")
        dist_utils.record_failure(e)
        return 1
    return 0


if __name__ == "__main__":
    main()
