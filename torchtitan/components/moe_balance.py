"""Load balancing and routing health for every MoE layer of this rank's model parts.

Auxiliary-loss-free balancing (DeepSeek-V3), after each optimizer step: the routing counts of the step's training
forwards (all micro-batches) are summed over the ranks that route different tokens (dp x cp, and tp, which splits
the MoE layers' tokens: ParallelDims.token_mesh), so every rank sees the global load, the same as one process would;
then each expert's bias moves by load_balance_coeff towards the mean load (up when it is below the mean, down when
above), and the counts restart. The bias only changes which experts tokens select, not their weights
(torchtitan/models/moe/router.py).

The balance loss and the router z-loss (torchtitan/models/moe/balance_loss.py) are set up here: their scale (1 /
tokens of the global batch) and the reduction of the balance loss's counts over the ranks of its scope.

Routing health: per layer and step, the busiest expert's load over the mean and the experts that received no token;
a layer whose load stays near its maximum (num_experts / top_k: every token on the same experts) is warned about.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.distributed import utils as dist_utils
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.tools.logging import logger


def moe_layers(model_parts: list[nn.Module]) -> dict[str, MoE]:
    """This rank's MoE layers by module name (e.g. "layers.3.moe", without wrapper prefixes)."""
    from torchtitan.components.model_parts import canonical_name

    return {canonical_name(name): m for part in model_parts for name, m in part.named_modules()
            if isinstance(m, MoE)}


def configure_balance_losses(named_layers: dict[str, MoE], parallel_dims, global_batch_size: int,
                             seq_len: int) -> None:
    """Each rank adds its tokens' losses / the global batch's tokens: summed over the ranks (and micro-batches) by
    the backward, that is the mean over the global batch. The balance loss's counts are summed over the ranks holding
    the rest of its scope's tokens: a sequence's or a micro-batch's (context and tensor parallel split them), or, for
    global_batch, every data rank's too. The sequence scope thus gives one process's gradient in every layout; the
    others count what one forward sees: one micro-batch (a pipeline micro-batch under pipeline parallel) of this data
    rank, or of every data rank; with gradient accumulation that is each micro-step, not the whole global batch
    (docs/models.md). The meshes must exist."""
    for layer in named_layers.values():
        layer.token_scale = 1.0 / (global_batch_size * seq_len)
        mesh = parallel_dims.token_mesh() if layer.args.aux_loss_scope == "global_batch" else \
            parallel_dims.sequence_mesh()
        layer.count_reduce = None if mesh is None or mesh.size() == 1 else \
            (lambda counts, mesh=mesh: dist_utils.all_reduce(counts, mesh, "sum"))


@torch.no_grad()
def update_expert_biases(named_layers: dict[str, MoE], data_mesh, pp_mesh=None, device: torch.device | None = None,
                         moe_args: MoEArgs | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Apply one balancing update and return the step's routing metrics: over the MoE layers of every stage, the
    largest ratio of an expert's token count to the mean count (1.0 is perfect balance) and the most experts a
    layer left without a token; with the balance loss or z-loss on (`moe_args`, default: the first layer's), each
    loss as added to the training loss (coefficient included), summed over the layers. Called on every rank of a
    model that has MoE layers, also on a pipeline rank whose stages hold none (it joins the reductions over pp).

    Also returns, per MoE layer of this rank, its expert load (max over mean) as metrics "moe_load/<layer>", its
    idle experts as "moe_idle_experts/<layer>", and its global tokens per expert (for a histogram)."""
    layers = list(named_layers.values())
    args = moe_args if moe_args is not None else (layers[0].args if layers else None)
    coeffs = torch.tensor([0.0, 0.0] if args is None else [args.aux_loss_coeff, args.router_z_loss_coeff],
                          dtype=torch.float64, device=device)
    if not layers:
        # The same reductions over pp, in the same order and dtypes, as the ranks whose stages hold MoE layers.
        losses = dist_utils.all_reduce(torch.zeros(2, dtype=torch.float64, device=device), pp_mesh, "sum")
        worst = dist_utils.all_reduce(torch.zeros(2, dtype=torch.float64, device=device), pp_mesh, "max")
        return _metrics(worst, losses, coeffs), {}
    counts = torch.stack([layer.tokens_per_expert for layer in layers])  # [layers, experts]
    counts = dist_utils.all_reduce(counts, data_mesh, "sum")
    # Each loss per layer: its sum over the step's tokens / their number, over every data rank; summed over the
    # layers of every stage.
    sums = dist_utils.all_reduce(torch.stack([layer.aux_loss_sum for layer in layers]), data_mesh, "sum")
    losses = dist_utils.all_reduce((sums[:, :2] / sums[:, 2:].clamp_min(1.0)).sum(dim=0).double(), pp_mesh, "sum")
    mean = counts.mean(dim=1, keepdim=True)
    for layer, layer_counts, layer_mean in zip(layers, counts, mean, strict=True):
        if layer.expert_bias is not None:
            layer.expert_bias += layer.args.load_balance_coeff * torch.sign(layer_mean - layer_counts)
        layer.tokens_per_expert.zero_()
        layer.aux_loss_sum.zero_()
    per_layer = counts.max(dim=1).values / mean.squeeze(1).clamp_min(1e-9)
    idle = (counts == 0).sum(dim=1).to(per_layer.dtype)
    worst = dist_utils.all_reduce(torch.stack([per_layer.max(), idle.max()]).double(), pp_mesh, "max")
    metrics = _metrics(worst, losses, coeffs)
    for name, load, none in zip(named_layers, per_layer.tolist(), idle.tolist(), strict=True):
        metrics[f"moe_load/{name}"] = load
        metrics[f"moe_idle_experts/{name}"] = int(none)
    return metrics, dict(zip(named_layers, counts.cpu(), strict=True))


def _metrics(worst: torch.Tensor, losses: torch.Tensor, coeffs: torch.Tensor) -> dict[str, float]:
    load, idle = worst.tolist()
    out = {"moe_load_max_over_mean": load, "moe_idle_experts_max": int(idle)}
    weighted = (losses * coeffs).tolist()
    if coeffs[0] > 0:
        out["moe_aux_loss"] = weighted[0]
    if coeffs[1] > 0:
        out["moe_z_loss"] = weighted[1]
    return out


class CollapseWatch:
    """Warns when an MoE layer of this rank stays near full collapse: its busiest expert's load over the mean at
    least `load_fraction` of the most possible, num_experts / top_k (reached when every token picks the same
    experts), for `after_steps` consecutive steps; then again every `every_steps` steps while it lasts."""

    def __init__(self, moe_args: MoEArgs, load_fraction: float, after_steps: int, every_steps: int) -> None:
        self.limit = moe_args.num_experts / moe_args.top_k
        self.threshold = load_fraction * self.limit
        self.after, self.every = after_steps, every_steps
        self.streak: dict[str, int] = {}

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Update the streaks from one step's metrics (update_expert_biases'); returns the layers warned about."""
        if self.threshold <= 0:
            return []
        warned = []
        for key, load in metrics.items():
            if not key.startswith("moe_load/"):
                continue
            name = key.removeprefix("moe_load/")
            streak = self.streak.get(name, 0) + 1 if load >= self.threshold else 0
            self.streak[name] = streak
            if streak >= self.after and (streak - self.after) % self.every == 0:
                warned.append(name)
                idle = metrics.get(f"moe_idle_experts/{name}", 0)
                logger.warning(
                    f"step {step}: MoE routing near collapse in {name or 'the MoE layer'} for {streak} steps: the "
                    f"busiest expert gets {load:.2f}x the mean load (at most {self.limit:.2f}), {idle} experts got "
                    "no token. Raise moe.load_balance_coeff or moe.aux_loss_coeff (docs/models.md, Load balancing)")
        return warned
