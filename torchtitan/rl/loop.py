"""GRPO post-training: prompts -> G completions each -> rewards -> advantages -> buffer -> policy update -> weights
to the generator. `GRPOTrainer.step` is the whole algorithm on one screen; the rest is set-up and helpers.

Layout: data parallelism (FSDP, HSDP, DDP) and tensor parallel (with FSDP too) through the trainer's own model
building (build_model_parts). Every rank draws the same prompts, generates its share of the groups (prompt i on
rank i % world: the generator is a whole model copy on every rank, so tp ranks generate too) with that copy, scores
them, and all ranks exchange the scored groups, so the replay buffer is replicated exactly. The sampled training
groups are then split over the data-parallel ranks (the tp ranks of one dp index train on the same samples); each
divides its loss sum by the global count of tokens (or sequences) and FSDP sums the gradients, which equal the
one-process gradient. Under loss parallel the logits stay sharded on the vocabulary (loss.token_logprobs).
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
from torchtitan.distributed.tensor_parallel import loss_parallel_context
from torchtitan.models.registry import get_model_spec
from torchtitan.rl.buffer import Group, ReplayBuffer
from torchtitan.rl.data import PromptStream, check_prompts_fit, encode_prompt, load_records, prompt_fits
from torchtitan.rl.generator import LocalGenerator, SamplingParams, full_state_dict
from torchtitan.rl.loss import group_advantages, grpo_loss, stat_means, token_logprobs
from torchtitan.rl.rewards import RewardSet, exact_answer
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
        self.generator = LocalGenerator(self._whole_model(spec, model_args, dtype))
        # The KL anchor is the policy the run started from: rebuilt the same way on resume, never saved.
        self.reference = self._reference(spec, model_args, dtype) if self.rl.kl_coeff > 0 else None

        buffer = ReplayBuffer(rl.buffer_sampling, rl.buffer_capacity, rl.buffer_max_lag, rl.drop_zero_variance,
                              seed=self.seed)
        self.state = RLState(data, buffer)
        self.rewards = RewardSet(rl.rewards, rl.reward_weights)
        self.sampling = SamplingParams(n=rl.group_size, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                                       top_p=rl.top_p, stop_tokens=self._stop_tokens())
        self.train_groups = rl.train_groups or rl.prompts_per_step

        self.train_state = TrainState()
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, dump_folder=cfg.job.dump_folder, model_parts=self.model_parts, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.state, train_state=self.train_state,
            model_args=model_args, world_size=pdims.world_size, rank=self.rank)
        self.checkpointer.load()
        self.checkpointer.check_continuation(cfg.training.steps)
        self.generator.update_weights(full_state_dict(self.model_parts), self.state.version)
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
            prompts = state.data.take(rl.prompts_per_step)[self.rank::self.world]  # this rank's share
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
            stats = self.update(batch) if batch else None  # one optimizer step with the GRPO loss
        with t("sync"):
            if stats is not None:
                state.version += 1
                self.generator.update_weights(full_state_dict(self.model_parts), state.version)
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
            dist.all_gather_object(gathered, groups)
            groups = [g for part in gathered for g in part]
        return sorted(groups, key=lambda g: g.index)

    def update(self, batch: list[Group]) -> dict[str, Any]:
        samples = [(g.prompt, c, lp, a) for g in batch
                   for c, lp, a in zip(g.completions, g.logprobs, g.advantages, strict=True)]
        # Normalisers over the whole batch (every rank holds it), so the ranks' gradients sum to one process's.
        total_tokens = sum(len(c) for _, c, _, _ in samples)
        normalizer = total_tokens if self.rl.loss_aggregation == "token" else len(samples)
        length = -(-max(len(p) + len(c) - 1 for p, c, _, _ in samples) // self.tp) * self.tp
        tokens, targets, mask, behaviour, adv = pack(samples[self.dp_rank::self.dp_size], length, self.device)
        model = self.model_parts[0]
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        # Loss parallel's vocab-sharded log-softmax needs its context in the forward and the backward.
        with loss_parallel_context(self.loss_parallel):
            with self.autocast:
                logits = model(tokens)
            logp, entropy = token_logprobs(logits, targets, entropy=True)
            ref_logp = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(self.reference(tokens), targets)[0]
            loss, stats = grpo_loss(logp, behaviour, adv, mask, clip_low=self.rl.clip_low,
                                    clip_high=self.rl.clip_high, kl_coeff=self.rl.kl_coeff, ref_logp=ref_logp,
                                    aggregation=self.rl.loss_aggregation, normalizer=normalizer, entropy=entropy)
            loss.backward()
        params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        grad_norm = dist_utils.total_grad_norm(params)
        dist_utils.clip_grads_(params, self.cfg.training.max_norm, grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()  # the schedule counts updates: a step without one leaves it
        names = sorted(stats)
        summed = dist_utils.all_reduce(torch.stack([stats[k] for k in names] + [loss.detach().float()]),
                                       self.dp_mesh, "sum")
        out = dict(zip(names, summed[:-1].tolist(), strict=True))
        out.update(loss=float(summed[-1]), grad_norm=float(grad_norm), trained_tokens=length * len(samples))
        self.train_state.tokens_seen += total_tokens
        return out

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
            values.update(loss=stats["loss"], grad_norm=stats["grad_norm"], lr=self.step_lr, **stat_means(stats))
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


def pack(samples: list, length: int, device: torch.device):
    """Right-padded [n, length] inputs (prompt + completion, last token dropped), targets, the mask of response
    targets, behaviour log-probs at those targets, and [n] advantages. No sample: one all-masked row, so this rank
    still joins FSDP's collectives with a zero loss."""
    n = max(len(samples), 1)
    tokens = torch.zeros(n, length, dtype=torch.long)
    targets = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.bool)
    behaviour = torch.zeros(n, length)
    adv = torch.zeros(n)
    for i, (prompt, completion, logprobs, advantage) in enumerate(samples):
        full = torch.tensor(list(prompt) + list(completion), dtype=torch.long)
        tokens[i, :full.numel() - 1] = full[:-1]
        targets[i, :full.numel() - 1] = full[1:]
        start = len(prompt) - 1  # the input position that predicts the first completion token
        mask[i, start:start + len(completion)] = True
        behaviour[i, start:start + len(completion)] = torch.tensor(logprobs)
        adv[i] = advantage
    return tokens.to(device), targets.to(device), mask.to(device), behaviour.to(device), adv.to(device)
