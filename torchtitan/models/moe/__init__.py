"""Mixture-of-experts building blocks (plain modules; parallelism is applied from torchtitan/distributed)."""

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.experts import GroupedExperts
from torchtitan.models.moe.moe import MoE, SharedExperts, no_token_counting
from torchtitan.models.moe.router import TopKRouter

__all__ = ["GroupedExperts", "MoE", "MoEArgs", "SharedExperts", "TopKRouter", "no_token_counting"]
