"""GRPO post-training: prompts -> G completions each -> rewards -> advantages -> buffer -> policy update -> weights
to the generator. `GRPOTrainer.step` is the whole algorithm on one screen; the rest is set-up and helpers.

Layout: data parallelism (FSDP, HSDP, DDP) and tensor parallel (with FSDP too) through the trainer's own model
building (build_model_parts). Every rank draws the same prompts, generates its share of the groups (prompt i on
rank i % world: the generator is a whole model copy on every rank, so tp ranks generate too) with that copy, scores
them, and all ranks exchange the scored groups, so the replay buffer is replicated exactly. The sampled training
groups are then split over the data-parallel ranks (the tp ranks of one dp index train on the same samples), in
mini-batches (one optimizer step each) and micro-batches (update.py); each rank divides its loss sum by the update's
global count of tokens (or sequences) and FSDP sums the gradients, which equal the one-process gradient. Under loss
parallel the logits stay sharded on the vocabulary (loss.token_logprobs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.metrics import MetricsLogger
from torchtitan.components.model_parts import build_model_parts, materialize, model_args_for
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_dict
from torchtitan.config.preflight import checked_tokenizer
from torchtitan.config.resolve import Resolved
from torchtitan.data.tokenizer import default_cache_dir
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.generation_tp import generation_tp_errors
from torchtitan.models.registry import get_model_spec
from torchtitan.rl.buffer import Group, ReplayBuffer
from torchtitan.rl.data import PromptStream, check_prompts_fit, encode_prompt, load_records, prompt_fits
from torchtitan.rl.generator import LocalGenerator, SamplingParams, TPGenerator, full_state_dict, sharded_state_dict
from torchtitan.rl.loss import group_advantages, stat_means
from torchtitan.rl.rewards import RewardSet, exact_answer
from torchtitan.rl.update import LossSettings, logit_chunks, merge_updates, mini_batches, policy_update, samples_of
from torchtitan.tools import device as device_tools
from torchtitan.tools.logging import logger


class RLState:
    """What a checkpoint needs beyond model, optimizer and scheduler: the data cursor, the buffer (with its
    generator) and the policy version. Saved in the checkpoint's `dataloader` slot (plain data)."""

    def __init__(self, data: PromptStream, buffer: ReplayBuffer):
        self.data, self.buffer, self.version = data, buffer, 0

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "buffer": self.buffer.state_dict(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.buffer.load_state_dict(state["buffer"])
        self.version = int(state["version"])


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


class GRPOTrainer:
    def __init__(self, cfg: JobConfig, resolved: Resolved, device: torch.device):
        self.cfg, self.rl, self.device = cfg, cfg.rl, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        pdims = resolved.parallel_dims
        pdims.build_mesh(device.type)
        self.dp_mesh = pdims.mesh("dp")
        self.dp_rank, self.dp_size = self.dp_mesh.get_local_rank(), self.dp_mesh.size()
        self.world = pdims.world_size
        # Sequence parallel shards the packed batch's sequence over tp: pad its length to a multiple of tp.
        self.tp = pdims.tp
        self.loss_parallel = pdims.loss_parallel_enabled(cfg.parallelism.disable_loss_parallel)
        self.seed = 0 if cfg.debug.seed is None else cfg.debug.seed
        dist_utils.set_determinism(self.seed, cfg.debug.deterministic)
        spec, model_args = get_model_spec(cfg.model.name), model_args_for(cfg)
        self.tokenizer = checked_tokenizer(cfg, model_args.vocab_size)
        rl = self.rl
        records = None if rl.task == "synthetic" else load_records(
            rl.dataset_path, rl.dataset_split, rl.dataset_config, str(default_cache_dir() / "datasets"))
        data = PromptStream(rl.task, self.seed, records=records, digits=rl.synthetic_digits, ops=rl.synthetic_ops)
        # Before building anything: a prompt that cannot fit would otherwise fail in the middle of a run.
        check_prompts_fit(data, lambda q: encode_prompt(self.tokenizer, q, rl.chat_template), rl.max_new_tokens,
                          cfg.training.seq_len, cfg.training.steps * rl.prompts_per_step, rl.dataset_path)
        param_dtype = device_tools.training_param_dtype(cfg.training.mixed_precision_param, device.type)

        self.model_parts = build_model_parts(cfg, pdims, None, param_dtype, model_args)
        materialize(self.model_parts, device, self.seed, dist_utils.param_init)
        self.autocast = dist_utils.mixed_precision_autocast(pdims, param_dtype, device.type)
        self.optimizer = OptimizersContainer(self.model_parts, cfg.optimizer, device.type)
        self.lr_scheduler = LRSchedulersContainer(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        dtype = torch.bfloat16 if param_dtype == "bfloat16" else torch.float32
        self.generator = self._generator(spec, model_args, pdims, dtype)
        # The KL anchor is the policy the run started from: rebuilt the same way on resume, never saved.
        self.reference = self._reference(spec, model_args, dtype) if self.rl.kl_coeff > 0 else None

        buffer = ReplayBuffer(rl.buffer_sampling, rl.buffer_capacity, rl.buffer_max_lag, rl.drop_zero_variance,
                              seed=self.seed)
        self.state = RLState(data, buffer)
        self.rewards = RewardSet(rl.rewards, rl.reward_weights)
        self.sampling = SamplingParams(n=rl.group_size, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                                       top_p=rl.top_p, stop_tokens=self._stop_tokens())
        self.train_groups = rl.train_groups or rl.prompts_per_step
        self.loss_settings = LossSettings(rl.clip_low, rl.clip_high, rl.kl_coeff, rl.loss_aggregation)
        # The output projections score a micro-batch's logits in chunks (training.loss_chunks, auto by their size:
        # update.py); the largest micro-batch holds this many completions of at most seq_len positions.
        rows = rl.micro_batch_size or -(-(rl.mini_batch_size or self.train_groups) * rl.group_size // self.dp_size)
        vocab = model_args.vocab_size
        self.model_parts[0].output.loss_chunks = logit_chunks(cfg.training.loss_chunks, rows * cfg.training.seq_len,
                                                              vocab // self.tp if self.loss_parallel else vocab)
        if self.reference is not None:
            self.reference.output.loss_chunks = logit_chunks(cfg.training.loss_chunks, rows * cfg.training.seq_len,
                                                             vocab)

        self.train_state = TrainState()
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, dump_folder=cfg.job.dump_folder, model_parts=self.model_parts, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.state, train_state=self.train_state,
            model_args=model_args, world_size=pdims.world_size, rank=self.rank)
        self.checkpointer.load()
        self.checkpointer.check_continuation(cfg.training.steps)
        self.generator.update_weights(self._policy_weights(), self.state.version)
        self.metrics = MetricsLogger(dump_folder=cfg.job.dump_folder, rank=self.rank, total_steps=cfg.training.steps,
                                     enable_tensorboard=cfg.metrics.enable_tensorboard,
                                     save_tb_folder=cfg.metrics.save_tb_folder, enable_wandb=cfg.metrics.enable_wandb,
                                     save_for_all_ranks=cfg.metrics.save_for_all_ranks, run_config=to_dict(cfg),
                                     resumed_after=self.train_state.step)
        logger.info(f"GRPO: {cfg.model.name}/{cfg.model.flavor}, {self.dp_size} data-parallel x {self.tp} tp rank(s), "
                    f"{rl.prompts_per_step} prompts x G={rl.group_size} per step, task {rl.task}")

    # ------------------------------------------------------------------ the algorithm
    def step(self, step: int) -> dict[str, float]:
        t, rl, state = Timer(), self.rl, self.state
        with t("generate"):
            prompts = state.data.take(rl.prompts_per_step)[self.gen_rank::self.gen_ranks]  # this rank's share
            ids = [encode_prompt(self.tokenizer, rec["question"], rl.chat_template) for _, rec in prompts]
            for (index, _), prompt in zip(prompts, ids, strict=True):  # what the pre-flight check did not cover
                if problem := prompt_fits(len(prompt), rl.max_new_tokens, self.cfg.training.seq_len):
                    raise ValueError(f"rl.max_new_tokens: prompt {index} {problem}")
            seeds = [self.seed * 1_000_003 + index for index, _ in prompts]  # per prompt: layout-independent
            completions = self.generator.generate(ids, self.sampling, seeds)
        with t("score"):
            groups = self.score(prompts, ids, completions)  # rewards, advantages; every rank's groups, in order
        dropped = state.buffer.add(groups)
        batch = state.buffer.sample(self.train_groups, state.version)
        with t("train"):
            stats = self.update(batch, step) if batch else None  # ppo_epochs x mini-batches optimizer steps
        with t("sync"):
            if stats is not None:
                state.version += 1
                self.generator.update_weights(self._policy_weights(), state.version)
        return self.log(step, groups, batch, dropped, stats, t.seconds)

    # ------------------------------------------------------------------ the pieces
    def score(self, prompts, ids, completions) -> list[Group]:
        groups = []
        for (index, rec), prompt, outs in zip(prompts, ids, completions, strict=True):
            texts = [self.tokenizer.decode([x for x in c.tokens if x not in self.sampling.stop_tokens]) for c in outs]
            rewards = [self.rewards(text, rec["answer"]) for text in texts]
            advantages = group_advantages(torch.tensor([rewards]), self.rl.std_normalize)[0].tolist()
            groups.append(Group(index=index, prompt=prompt, completions=[c.tokens for c in outs],
                                logprobs=[c.logprobs for c in outs], rewards=rewards, advantages=advantages,
                                correct=[exact_answer(text, rec["answer"]) for text in texts],
                                version=self.state.version))
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, groups if self.gen_owner else [])  # tp ranks hold the same groups
            groups = [g for part in gathered for g in part]
        return sorted(groups, key=lambda g: g.index)

    def update(self, batch: list[Group], step: int) -> dict[str, Any]:
        """rl.ppo_epochs passes over the drawn groups, one optimizer update per mini-batch (update.py)."""
        rl = self.rl
        shuffle_seed = self.seed * 1_000_003 + step if rl.shuffle_mini_batches else None
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        results = [policy_update(self.model_parts, self.optimizer, samples_of(mini), self.loss_settings,
                                 device=self.device, dp_mesh=self.dp_mesh, micro_batch_size=rl.micro_batch_size,
                                 multiple=self.tp, reference=self.reference, autocast=self.autocast,
                                 loss_parallel=self.loss_parallel, max_norm=self.cfg.training.max_norm)
                   for mini in mini_batches(batch, rl.mini_batch_size, rl.ppo_epochs, shuffle_seed)]
        # Once per RL step with an update, however many it made: training.steps stays the schedule's length.
        self.lr_scheduler.step()
        self.train_state.tokens_seen += sum(len(c) for g in batch for c in g.completions)
        return merge_updates(results)

    def log(self, step, groups, batch, dropped, stats, seconds) -> dict[str, float]:
        rewards = torch.tensor([r for g in groups for r in g.rewards])
        lengths = [len(c) for g in groups for c in g.completions]
        generated = sum(lengths)
        values: dict[str, Any] = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "accuracy": sum(c for g in groups for c in g.correct) / max(len(lengths), 1),
            "response_len": generated / max(len(lengths), 1), "groups_dropped": dropped,
            "trained_groups": len(batch), "buffer_size": len(self.state.buffer), "policy_version": self.state.version,
            "gen_tps": round(generated / max(self._global_max(seconds["generate"]), 1e-9), 1),
        }
        if stats is not None:
            values.update(loss=stats["loss"], grad_norm=stats["grad_norm"], lr=self.step_lr, updates=stats["updates"],
                          **stat_means(stats))
            values["train_tps"] = round(stats["trained_tokens"] / max(seconds["train"], 1e-9), 1)
        values.update({f"time/{k}": round(v, 4) for k, v in seconds.items()})
        values["tokens_seen"] = self.train_state.tokens_seen
        self.metrics.log(step, values)
        logger.info(f"step {step}: reward {values['reward_mean']:.3f} (std {values['reward_std']:.3f}) acc "
                    f"{values['accuracy']:.3f} len {values['response_len']:.1f} kl {values.get('kl', 0):.4f} clip "
                    f"{values.get('clip_frac', 0):.3f} entropy {values.get('entropy', 0):.3f} | time " +
                    " ".join(f"{k} {v:.2f}s" for k, v in seconds.items()))
        return values

    def train(self, until: int | None = None) -> None:
        """Steps up to training.steps (or `until`, for tests that stop a run midway), checkpointing as configured."""
        for step in range(self.train_state.step + 1, (until or self.cfg.training.steps) + 1):
            self.step(step)
            self.train_state.step = step
            self.checkpointer.maybe_save(step, last_step=step == self.cfg.training.steps)

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()

    # ------------------------------------------------------------------ set-up helpers
    def _global_max(self, seconds: float) -> float:
        # Generation is spread over all ranks: the slowest rank's time is the step's.
        value = torch.tensor(seconds, device=self.device)
        if self.world > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    def _generator(self, spec, model_args, pdims, dtype: torch.dtype):
        """Tensor parallel: the generator split over the tp ranks, which then generate each data-parallel index's
        prompts together (an MoE model keeps a whole copy per rank). Otherwise a whole copy on each rank."""
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        if self.tp > 1 and not generation_tp_errors(model, self.tp):
            self.gen_rank, self.gen_ranks = self.dp_rank, self.dp_size
            self.gen_owner = pdims.mesh("tp").get_local_rank() == 0
            return TPGenerator(model, pdims.mesh("tp"), spec.tp_block_plan, device=self.device, dtype=dtype)
        self.gen_rank, self.gen_ranks, self.gen_owner = self.rank, self.world, True
        return LocalGenerator(self._whole_model(spec, model_args, dtype))

    def _policy_weights(self) -> dict[str, torch.Tensor]:
        # TPGenerator gathers each parameter over the data-parallel dims only; LocalGenerator takes whole tensors.
        if isinstance(self.generator, TPGenerator):
            return sharded_state_dict(self.model_parts)
        return full_state_dict(self.model_parts)

    def _whole_model(self, spec, model_args, dtype: torch.dtype) -> torch.nn.Module:
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        materialize([model], self.device, self.seed, dist_utils.param_init)
        return model.to(dtype)

    def _reference(self, spec, model_args, dtype: torch.dtype) -> torch.nn.Module:
        """The initial policy: the same seeded initialisation, or checkpoint.initial_load_path's weights."""
        model = self._whole_model(spec, model_args, torch.float32)
        if self.cfg.checkpoint.initial_load_path:
            loader = CheckpointManager(dataclasses.replace(self.cfg.checkpoint, enable=False),
                                       dump_folder=self.cfg.job.dump_folder, model_parts=[model], optimizer=None,
                                       lr_scheduler=None, dataloader=None, train_state=TrainState(),
                                       model_args=model_args, world_size=1, rank=self.rank)
            loader.load()
            loader.close()
        return model.to(dtype).eval().requires_grad_(False)

    def _stop_tokens(self) -> tuple[int, ...]:
        if self.rl.chat_template:
            from torchtitan.data.chat import stop_token_ids

            return tuple(stop_token_ids(self.tokenizer, self.rl.chat_template))
        return (self.tokenizer.eos_id,)
