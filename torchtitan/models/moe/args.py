"""Mixture-of-experts hyperparameters, shared by every model family that has MoE layers."""

from __future__ import annotations

from dataclasses import dataclass

AUX_LOSS_SCOPES = ("sequence", "microbatch", "global_batch")


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int = 8
    """routed experts per MoE layer"""
    top_k: int = 2
    """routed experts each token goes to"""
    hidden_dim: int = 256
    """hidden size of one expert's SwiGLU MLP (Hugging Face: moe_intermediate_size)"""
    num_shared_experts: int = 0
    """experts every token goes through (one SwiGLU MLP of num_shared_experts x hidden_dim)"""
    score_func: str = "softmax"
    """softmax | sigmoid: how router logits become scores"""
    route_norm: bool = True
    """divide each token's top-k scores by their sum (Hugging Face: norm_topk_prob)"""
    route_scale: float = 1.0
    """multiplier on the routing weights (Hugging Face: routed_scaling_factor)"""
    num_expert_groups: int = 1
    """group-limited routing: experts form this many groups (Hugging Face: n_group)"""
    num_limited_groups: int = 1
    """... and a token's top-k come from its best this-many groups (Hugging Face: topk_group)"""
    load_balance_coeff: float = 0.0
    """auxiliary-loss-free balancing: after each optimizer step every expert's routing bias moves by this much
    towards the mean load (0 = off, no bias)"""
    aux_loss_coeff: float = 0.0
    """weight of the balance loss added to the training loss: sum over experts of f_i x P_i, f_i the share of routed
    (token, slot) pairs on expert i times num_experts (1 when balanced), P_i its mean normalised score; 0 = off"""
    aux_loss_scope: str = "sequence"
    """the tokens f_i and P_i count over: sequence (DeepSeek-V3's complementary loss), microbatch (one data rank's
    micro-batch) or global_batch (every data rank's micro-batch: Qwen3's global-batch loss); docs/models.md"""
    router_z_loss_coeff: float = 0.0
    """weight of the router z-loss (ST-MoE): the mean over tokens of logsumexp(router logits)^2; 0 = off"""
    use_grouped_mm: bool = True
    """run the experts with torch._grouped_mm (one kernel for all experts) instead of a loop over experts"""

    def active_matmul_params(self, dim: int) -> int:
        """Matmul weights one token goes through in an MoE layer of model width `dim`: the router, its top_k routed
        experts and the shared ones (three projections each); the FLOPs counts take 6 per weight."""
        return dim * self.num_experts + 3 * dim * self.hidden_dim * (self.top_k + self.num_shared_experts)

    def check(self) -> list[str]:
        """Problems with these values, one line each (empty when consistent)."""
        errors = []
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            errors.append(f"moe: top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.score_func not in ("softmax", "sigmoid"):
            errors.append(f"moe: score_func '{self.score_func}' is not one of softmax, sigmoid")
        groups, limited = self.num_expert_groups, self.num_limited_groups
        if groups < 1 or self.num_experts % groups or not 1 <= limited <= groups:
            errors.append(f"moe: num_expert_groups={groups} must divide num_experts={self.num_experts} and "
                          f"num_limited_groups={limited} be in [1, {groups}]")
        elif groups > 1 and limited * (self.num_experts // groups) < self.top_k:
            errors.append(f"moe: num_limited_groups={limited} groups of {self.num_experts // groups} experts hold "
                          f"fewer than top_k={self.top_k}")
        for key in ("load_balance_coeff", "aux_loss_coeff", "router_z_loss_coeff"):
            if not getattr(self, key) >= 0:
                errors.append(f"moe.{key}: must be >= 0 (0 = off), got {getattr(self, key)}")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            errors.append(f"moe.aux_loss_scope: '{self.aux_loss_scope}' is not one of {', '.join(AUX_LOSS_SCOPES)}")
        return errors
