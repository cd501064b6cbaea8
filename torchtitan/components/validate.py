"""Periodic validation: loss and perplexity over a held-out dataset, under any data-parallel layout.

Every evaluation starts a fresh one-pass loader over the same documents, so the numbers of different steps
compare. The finite loader pads the last global batch so that every rank runs the same number of forward
passes (FSDP gathers parameters inside forward: a rank with one batch fewer would hang the others).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from types import SimpleNamespace

import torch
import torch.nn as nn

from torchtitan.components.loss import count_target_tokens
from torchtitan.config.job_config import JobConfig
from torchtitan.data.chat_loader import build_sft_dataloader
from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.datasets import build_document_source
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import shard_microbatches
from torchtitan.distributed.fsdp import reshard
from torchtitan.distributed.tensor_parallel import local_value, loss_parallel_context
from torchtitan.tools.logging import logger


def validation_shape(cfg: JobConfig) -> tuple[int, int]:
    """(local batch size, seq_len) of validation from a config that torchtitan/config/resolve.py filled in."""
    v = cfg.validation
    if v.local_batch_size == -1 or v.seq_len == -1:
        # The -1 rule lives in resolve.py only; a second copy here could drift from it.
        raise ValueError("validation.local_batch_size / validation.seq_len are still -1: resolve the config first "
                         "(torchtitan.config.resolve.resolve or torchtitan.config.manager.load_config)")
    return v.local_batch_size, v.seq_len


class Validator:
    def __init__(self, cfg: JobConfig, tokenizer, dp_rank: int, dp_degree: int, loss_mesh, device: torch.device,
                 cache_dir: str | None = None, *, loss_parallel: bool = False,
                 eager: bool = False, pp_mesh=None, cp_mesh=None):
        """`eager` runs compiled blocks uncompiled (see Trainer: TP + compile under no_grad). With pipeline
        parallel (`pp_mesh`) the loss comes from the last stage's ranks and is summed over pp; with context
        parallel (`cp_mesh`) each rank scores its own share of every sequence."""
        self.cfg, self.tokenizer, self.loss_mesh, self.device = cfg, tokenizer, loss_mesh, device
        self.pp_mesh, self.cp_mesh = pp_mesh, cp_mesh
        self.loss_parallel, self.eager = loss_parallel, eager
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.local_batch_size, self.seq_len = validation_shape(cfg)
        # Built now, so a missing file or column fails before the first training step.
        if cfg.training.dataset_format != "text":  # held-out conversations, rendered and labelled as training's
            self.source, self.loader = self._chat_loader(cfg, tokenizer, cache_dir)
            return
        self.source = build_document_source(
            dataset=cfg.validation.dataset,
            dataset_path=cfg.validation.dataset_path,
            text_column=cfg.validation.dataset_text_column,
            split=cfg.validation.dataset_split,
            streaming=cfg.validation.dataset_streaming,
            cache_dir=cache_dir,
            key_prefix="validation",
        )

        # One finite loader for the whole run: each iter() is a fresh full pass over the same documents.
        self.loader = build_dataloader(
            source=self.source,
            tokenizer=tokenizer,
            seq_len=self.seq_len,
            local_batch_size=self.local_batch_size,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            infinite=False,
            document_masking=cfg.model.attn_mask_type == "block_causal",
        )

    def _chat_loader(self, cfg: JobConfig, tokenizer, cache_dir: str | None):
        t, v = cfg.training, cfg.validation
        chat = SimpleNamespace(dataset=v.dataset, dataset_path=v.dataset_path, dataset_format=t.dataset_format,
                               chat_template=t.chat_template, train_on=t.train_on, sft_packing=t.sft_packing,
                               truncation=t.truncation)
        return build_sft_dataloader(
            chat, dict(split=v.dataset_split, streaming=v.dataset_streaming, cache_dir=cache_dir),
            dict(tokenizer=tokenizer, seq_len=self.seq_len, local_batch_size=self.local_batch_size,
                 dp_rank=self.dp_rank, dp_degree=self.dp_degree, infinite=False,
                 document_masking=cfg.model.attn_mask_type == "block_causal"),
            key_prefix="validation")

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], autocast, pipeline=None) -> dict[str, float]:
        with torch.compiler.set_stance("force_eager") if self.eager else nullcontext():
            return self._validate(model_parts, autocast, pipeline)

    def _validate(self, model_parts: list[nn.Module], autocast, pipeline) -> dict[str, float]:
        loader = self.loader
        for part in model_parts:
            part.eval()
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        batches = 0
        for batch in loader:
            if self.cfg.validation.steps != -1 and batches >= self.cfg.validation.steps:
                break  # every rank yields the same number of batches, so all stop together
            [batch] = shard_microbatches([batch], self.cp_mesh)
            inputs = {key: value.to(self.device) for key, value in batch.items()}
            input_ids, labels = inputs.pop("tokens"), inputs.pop("labels")
            with autocast, loss_parallel_context(self.loss_parallel):
                if pipeline is not None:  # forward only, through the stages; the loss on the last one
                    loss_sum += pipeline.eval_loss_sum(input_ids, labels, inputs)
                else:
                    loss_sum += local_value(model_parts[0](input_ids, labels=labels, **inputs))
            tokens += count_target_tokens(labels)
            batches += 1
        for part in model_parts:
            reshard(part)  # see distributed/fsdp.py: gathered parameters would break the next training step
            part.train()
        total_loss = dist_utils.all_reduce(dist_utils.all_reduce(loss_sum, self.pp_mesh, "sum"), self.loss_mesh, "sum")
        total_tokens = dist_utils.all_reduce(tokens, self.loss_mesh, "sum")
        if int(total_tokens) == 0:
            raise ValueError("validation: the validation data produced no target tokens")
        loss = (total_loss / total_tokens).item()
        logger.info(f"validation: loss {loss:.4f}  perplexity {math.exp(min(loss, 50.0)):.2f}  "
                    f"({int(total_tokens):,} tokens, {batches} batches per rank)")
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0)), "val_tokens": int(total_tokens)}

