"""Auxiliary-loss-free load balancing (DeepSeek-V3) for every MoE layer of this rank's model parts.

After each optimizer step: the routing counts of the step's training forwards (all micro-batches) are summed over
the ranks that route different tokens (dp x cp, and tp, which splits the MoE layers' tokens:
ParallelDims.token_mesh), so every rank sees the global load, the same as one process would; then each expert's
bias moves by load_balance_coeff towards the mean load (up when it is below the mean, down when above), and the
counts restart. The bias only changes which experts tokens select, not their weights
(torchtitan/models/moe/router.py).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.distributed import utils as dist_utils
from torchtitan.models.moe import MoE


def moe_layers(model_parts: list[nn.Module]) -> dict[str, MoE]:
    """This rank's MoE layers by module name (e.g. "layers.3.moe", without wrapper prefixes)."""
    from torchtitan.components.model_parts import canonical_name

    return {canonical_name(name): m for part in model_parts for name, m in part.named_modules()
            if isinstance(m, MoE)}


@torch.no_grad()
def update_expert_biases(named_layers: dict[str, MoE], data_mesh, pp_mesh=None, device: torch.device | None = None,
                         has_aux: bool = False) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Apply one balancing update and return the step's load metric: over the MoE layers of every stage, the
    largest ratio of an expert's token count to the mean count (1.0 is perfect balance), and with `has_aux` (the
    model has a balance loss) that loss, summed over the layers. Called on every rank of a model that has MoE
    layers, also on a pipeline rank whose stages hold none (it joins the reductions over pp).

    Also returns, per MoE layer of this rank, its expert load (max over mean) as metrics "moe_load/<layer>" and its
    global tokens per expert (for a histogram)."""
    layers = list(named_layers.values())
    if not layers:
        worst = dist_utils.all_reduce(torch.zeros((), device=device), pp_mesh, "max")
        aux_total = dist_utils.all_reduce(torch.zeros((), device=device), pp_mesh, "sum")
        return _metrics(worst, aux_total, has_aux), {}
    counts = torch.stack([layer.tokens_per_expert for layer in layers])  # [layers, experts]
    counts = dist_utils.all_reduce(counts, data_mesh, "sum")
    # The balance loss per layer: its sum over the step's sequences / their number, over every data rank; summed
    # over the layers of every stage.
    aux = dist_utils.all_reduce(torch.stack([layer.aux_loss_sum for layer in layers]), data_mesh, "sum")
    aux_total = dist_utils.all_reduce((aux[:, 0] / aux[:, 1].clamp_min(1.0)).sum(), pp_mesh, "sum")
    for layer in layers:
        layer.aux_loss_sum.zero_()
    mean = counts.mean(dim=1, keepdim=True)
    for layer, layer_counts, layer_mean in zip(layers, counts, mean, strict=True):
        if layer.expert_bias is not None:
            layer.expert_bias += layer.args.load_balance_coeff * torch.sign(layer_mean - layer_counts)
        layer.tokens_per_expert.zero_()
    per_layer = counts.max(dim=1).values / mean.squeeze(1).clamp_min(1e-9)
    metrics = _metrics(dist_utils.all_reduce(per_layer.max(), pp_mesh, "max"), aux_total, has_aux)
    metrics.update({f"moe_load/{name}": float(load) for name, load in zip(named_layers, per_layer, strict=True)})
    return metrics, dict(zip(named_layers, counts.cpu(), strict=True))


def _metrics(worst: torch.Tensor, aux_total: torch.Tensor, has_aux: bool) -> dict[str, float]:
    out = {"moe_load_max_over_mean": float(worst)}
    if has_aux:
        out["moe_aux_loss"] = float(aux_total)
    return out


def set_aux_loss_scale(named_layers: dict[str, MoE], global_batch_size: int) -> None:
    """Each rank adds its sequences' balance losses / the global batch's sequence count: summed over the ranks (and
    micro-batches) by the backward, that is the mean over the global batch, the same gradient in every layout."""
    for layer in named_layers.values():
        layer.aux_loss_scale = 1.0 / global_batch_size
