"""Parallel degrees -> one DeviceMesh with named dimensions, and the derived views each job uses.

Mesh layout, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp. TP is innermost so its ranks are
neighbours (same node); pp is outermost because it talks least. Expert parallel does not multiply the world:
it borrows ranks from dp_shard x cp.

Derived views, each for exactly one purpose:
- "dp"          (dp_replicate x dp_shard): which ranks read different data
- "dp_shard_cp" (dp_shard x cp): the ranks FSDP shards parameters over
- "dp_cp"       (dp_replicate x dp_shard x cp): the ranks the loss (token count) is reduced over
- "dp_replicate": the ranks DDP / HSDP replicate over
- "ep"          (expert parallel, a second mesh over the same ranks: pp, dp_replicate, efsdp, tp, ep, where
                efsdp x ep = dp_shard x cp and ep is the inner part): the ranks one layer's experts are spread over
- with tensor parallel, MoE layers split their tokens over tp (torchtitan/distributed/tensor_parallel.py), so tp
  ranks are data-parallel ranks for them: "dp_cp_tp" (the ranks whose routing counts are summed), the MoE FSDP mesh
  (dp_shard x cp x tp) and the expert FSDP mesh (efsdp x tp)

All validation happens in `__post_init__`, i.e. before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Parallelism

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _err(msg: str) -> None:
    raise ConfigError(msg)


@dataclass
class ParallelDims:
    dp_replicate: int
    """data_parallel_replicate_degree"""
    dp_shard: int
    """data_parallel_shard_degree (-1 = leftover ranks, resolved here)"""
    cp: int
    """context_parallel_degree"""
    tp: int
    """tensor_parallel_degree"""
    pp: int
    """pipeline_parallel_degree"""
    ep: int
    """expert_parallel_degree (borrowed from dp_shard x cp)"""
    world_size: int
    """number of processes in the job"""
    etp: int = 1
    """expert_tensor_parallel_degree (1, or tp: the experts' hidden units split over the tp ranks)"""
    _world_mesh: object | None = field(default=None, init=False, repr=False)
    _views: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_config(cls, p: Parallelism, world_size: int) -> ParallelDims:
        return cls(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            world_size=world_size,
            etp=p.expert_tensor_parallel_degree,
        )

    def _validate(self) -> None:
        names = {
            "dp_replicate": "parallelism.data_parallel_replicate_degree",
            "cp": "parallelism.context_parallel_degree",
            "tp": "parallelism.tensor_parallel_degree",
            "pp": "parallelism.pipeline_parallel_degree",
            "ep": "parallelism.expert_parallel_degree",
        }
        if self.world_size < 1:
            _err(f"world size must be >= 1, got {self.world_size}")
        for attr, key in names.items():
            if getattr(self, attr) < 1:
                _err(f"{key}: must be >= 1, got {getattr(self, attr)}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        layout = f"dp_replicate={self.dp_replicate} x cp={self.cp} x tp={self.tp} x pp={self.pp}"
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                _err(
                    f"parallelism: {layout} = {others} does not divide the world size {self.world_size} "
                    "(data_parallel_shard_degree=-1 takes the leftover ranks)"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            _err(f"parallelism.data_parallel_shard_degree: must be -1 or >= 1, got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            _err(
                f"parallelism: {layout} x dp_shard={self.dp_shard} = {others * self.dp_shard} "
                f"but the world size is {self.world_size}; the degrees must multiply to the number of processes"
            )
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep != 0:
            _err(
                f"parallelism.expert_parallel_degree={self.ep} must divide dp_shard x cp = "
                f"{self.dp_shard * self.cp} (expert parallel borrows those ranks)"
            )
        if self.etp not in (1, self.tp):
            _err(f"parallelism.expert_tensor_parallel_degree={self.etp} must be 1 or tensor_parallel_degree="
                 f"{self.tp} (the experts' hidden units are split over the tp ranks)")
        if self.etp > 1 and self.ep > 1 and (self.efsdp > 1 or self.dp_replicate > 1):
            # FSDP would have to shard weights that are already 2-D DTensors (tp x ep): not built yet.
            _err(f"parallelism.expert_tensor_parallel_degree={self.etp} with expert_parallel_degree={self.ep} needs "
                 f"the ep degree to take all of dp_shard x cp = {self.dp_shard * self.cp} and no "
                 "data_parallel_replicate_degree (FSDP over tensor- and expert-parallel experts is not available yet)")

    # ---- degrees of the derived views -------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        """Ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_degree(self) -> int:
        return self.dp_shard * self.cp

    @property
    def loss_degree(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def same_tokens_size(self) -> int:
        """Ranks that process the same tokens (tp x pp): a rank's token count over time, divided by it, is the
        throughput per device. Context-parallel ranks each count only their own share of the sequence."""
        return self.tp * self.pp

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """The ranks of dp_shard x cp that expert parallel leaves over (each holds a replica of the same experts)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def loss_parallel_enabled(self, disable_loss_parallel: bool) -> bool:
        """Cross-entropy on vocab-sharded logits: with tensor parallel, unless turned off."""
        return self.tp_enabled and not disable_loss_parallel

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication: DDP when nothing shards parameters. With TP, replication is HSDP with shard
        degree 1 instead: DDP does not take DTensor parameters. With pipeline parallel too: a stage runs several
        backwards per step, and only FSDP's gradient sync is switched per micro-batch by torch's pipeline stage."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1 and self.tp == 1 and self.pp == 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 (or HSDP when dp_replicate > 1) manages parameters: there is something to shard (dp_shard x cp
        > 1), or replication that DDP cannot take (with TP). Nothing wraps a model whose data-parallel degree is
        1 (one process, TP or PP alone): a wrapper there only costs time, and bf16 comes from autocast."""
        return self.fsdp_degree > 1 or (self.dp_replicate > 1 and not self.ddp_enabled)

    @property
    def autocast_enabled(self) -> bool:
        """Mixed precision by autocast rather than FSDP's policy: wherever FSDP does not manage the parameters."""
        return not self.fsdp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    # ---- the mesh ---------------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """Create the world mesh (all five named dims, size-1 ones included) and the flattened views."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(self, d) for d in MESH_DIMS)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        # torch asks callers to keep flattened views themselves rather than slice them from the root again.
        self._views = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        }
        if self.tp > 1:
            # Parameters of FSDP x TP live on (dp_shard_cp, tp), of HSDP x TP on (dp_replicate, dp_shard_cp, tp).
            # With these flattened groups registered, DTensor reduces a value that is partial over all of those
            # dims (the gradient norm) in one all-reduce instead of one per dim.
            self._views["dp_shard_cp_tp"] = mesh["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
            if self.dp_replicate > 1:
                self._views["dp_cp_tp"] = mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp")
            else:
                self._views["dp_cp_tp"] = self._views["dp_shard_cp_tp"]
            if self.cp > 1:
                self._views["cp_tp"] = mesh["cp", "tp"]._flatten("cp_tp")
        if self.ep > 1:
            # The same ranks in a second layout: dp_shard x cp split into (efsdp, ep), ep inner, so one layer's
            # experts are spread over the nearest ranks of the same tp index. ep is listed last (the groups are the
            # same): FSDP puts its mesh dimension before ep's in an expert weight's 2-D mesh, and DTensor merges
            # the two dimensions of a reduction only when they come in the mesh's order. Its process groups are
            # created here, with the rest.
            from torch.distributed.device_mesh import DeviceMesh

            layout = mesh.mesh.reshape(self.pp, self.dp_replicate, self.efsdp, self.ep, self.tp).transpose(3, 4)
            self._views["expert_mesh"] = DeviceMesh(device_type, layout.contiguous(),
                                                    mesh_dim_names=("pp", "dp_replicate", "efsdp", "tp", "ep"))
            self._views["ep"] = self._views["expert_mesh"]["ep"]
            if self.tp > 1:
                self._views["efsdp_tp"] = self._views["expert_mesh"]["efsdp", "tp"]._flatten("efsdp_tp")
            if self.etp > 1:
                self._views["tp_ep"] = self._views["expert_mesh"]["tp", "ep"]
        self._world_mesh = mesh
        return mesh

    @property
    def world_mesh(self):
        if self._world_mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._world_mesh

    def mesh(self, view: str):
        """A named view: 'dp', 'dp_shard_cp', 'dp_cp', 'dp_replicate', 'ep' (with expert parallel), or a plain mesh
        dim name."""
        if view in self._views:
            return self._views[view]
        return self.world_mesh[view]

    def expert_fsdp_mesh(self):
        """The mesh FSDP shards expert parallel's weights over: the ranks that hold the same experts, i.e. those of
        dp_shard x cp that EP leaves (efsdp), times tp (tensor parallel splits the MoE layers' tokens, not their
        experts), with dp_replicate for HSDP; None when there is no such rank (each expert then exists once)."""
        if self.etp > 1:
            # The experts are sharded over tp (and ep) and replicated over the ranks FSDP shards the rest over; with
            # expert parallel too, validation made sure there are none.
            return self.fsdp_mesh() if self.fsdp_enabled and not self.ep_enabled else None
        if self.efsdp == 1 and self.dp_replicate == 1 and self.tp == 1:
            return None
        expert_mesh = self._views["expert_mesh"]
        inner = "efsdp_tp" if self.tp > 1 else "efsdp"
        if self.dp_replicate > 1:
            return expert_mesh["dp_replicate", inner]
        return expert_mesh[inner]

    def expert_weight_mesh(self):
        """The mesh the routed experts' weights are DTensors on: ep (expert parallel), tp (tensor parallel inside
        the experts), or (tp, ep) for both; None when neither is on."""
        if self.ep > 1:
            return self._views["tp_ep"] if self.etp > 1 else self._views["ep"]
        return self.world_mesh["tp"] if self.etp > 1 else None

    def moe_fsdp_mesh(self):
        """With tensor parallel: the mesh FSDP shards the MoE layers' other parameters over (router, shared experts,
        and the routed experts without expert parallel). Each tp rank runs them on its own S / tp tokens, so their
        gradients are sums over dp_shard x cp x tp (with dp_replicate for HSDP). None without tensor parallel."""
        if self.tp == 1:
            return None
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard_cp_tp"]
        return self._views["dp_shard_cp_tp"]

    def token_mesh(self):
        """The ranks whose MoE layers route different tokens (their routing counts are summed over it): dp x cp,
        and tp with tensor parallel (which splits each MoE layer's tokens over tp)."""
        return self._views["dp_cp_tp"] if self.tp > 1 else self._views["dp_cp"]

    def sequence_mesh(self):
        """The ranks among which an MoE layer's tokens of one sequence are split: cp x tp (context parallel splits
        every sequence, tensor parallel the MoE layers' share again); None when a rank holds whole sequences."""
        if self.cp > 1 and self.tp > 1:
            return self._views["cp_tp"]
        if self.cp > 1 or self.tp > 1:
            return self.world_mesh["cp" if self.cp > 1 else "tp"]
        return None

    def fsdp_mesh(self):
        """1-D (dp_shard_cp) mesh for FSDP, or 2-D (dp_replicate, dp_shard_cp) for HSDP."""
        if self.hsdp_enabled:
            if self.cp == 1:
                return self.world_mesh["dp_replicate", "dp_shard"]
            return self.world_mesh["dp_replicate", "dp_shard_cp"]
        return self._views["dp_shard_cp"]

