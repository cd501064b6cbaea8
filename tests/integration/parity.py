"""What every rank of a pool (tests/integration/pool.py) runs for one layout, and how runs are compared.

`run_layout` parses the layout's command line with the trainer's own config code, builds the Trainer exactly as
`run_train.sh` would (mesh, model, parallelisms, data, optimizer, checkpoint), trains, and returns per step the
metrics the trainer logged (loss, gradient norm before clipping, validation loss), a fingerprint of every
parameter's gradient before clipping and of every parameter after the update. `compare` checks a run against the
1-process reference at the tolerances of docs/testing.md, every tensor on its own.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.integration.faults import FAULTS
from torchtitan.components.model_parts import named_parameters

# Tolerances, relative, derived in docs/testing.md from the measured noise floor of mathematically equal runs.
TOLERANCE = {"loss": 3e-6, "val_loss": 2e-6, "grad_norm": 1e-6, "moe_aux_loss": 2e-6, "moe_z_loss": 2e-6,
             # every tensor on its own: each parameter's gradient norm before clipping, its values, and after the
             # last step AdamW's moments (as sensitive as the values: an element whose first gradient is near zero
             # moves by +-lr whatever its size, and the next gradient with it; LoRA's floor: 2.0e-5, 2026-11-27)
             "grad": 2e-5, "param": 1e-4, "exp_avg": 1e-4, "exp_avg_sq": 1e-4}
METRICS = ("loss", "grad_norm", "val_loss", "moe_aux_loss", "moe_z_loss")
# The optimizer state compared after the last step: what a later step would see only through its update.
MOMENTS = ("exp_avg", "exp_avg_sq")
# Per reference and tensor, a tighter tolerance where that tensor's measured differences allow one: 10x the largest
# over its noise floor and every layout, at least TENSOR_TOLERANCE_MIN (written by `python -m
# tests.integration.noise_floor --write`, docs/testing.md). Tensors not listed use TOLERANCE["grad"/"param"].
TENSOR_TOLERANCE_FILE = Path(__file__).parent / "data" / "tensor_tolerances.json"
TENSOR_TOLERANCE = json.loads(TENSOR_TOLERANCE_FILE.read_text()) if TENSOR_TOLERANCE_FILE.exists() else {}
TENSOR_TOLERANCE_MIN = 1e-7
# Float8 turns float32 reduction-order noise into an occasional float8 rounding that goes the other way: under TP
# a few tensors' gradient norms move by up to 8.4e-5 (2026-11-26, docs/float8.md), so their tolerances may exceed
# the float32 ceilings, up to this factor.
FLOAT8_TENSOR_CEILING = 50
# References whose layouts need other tolerances than TOLERANCE, each 10x the largest difference measured (noise
# floor or layout; docs/float8.md). Their tensors' ceilings are these, times FLOAT8_TENSOR_CEILING.
REFERENCE_TOLERANCE: dict[str, dict[str, float]] = {
    # float8 rowwise: a scale per row, so float32 noise flips roundings in many more places than with tensorwise
    # scales. FSDP 2 x TP 2 against its 1-process run (2026-11-26): loss 5.8e-7, validation loss 5.6e-7, gradient
    # norm 1.3e-6, one tensor's gradient norm up to 1.3e-3 and its values up to 7.3e-3
    "single_process_float8_rowwise_rows4": {**TOLERANCE, "loss": 1e-5, "val_loss": 1e-5, "grad_norm": 2e-5,
                                            "grad": 2e-2, "param": 1e-1, "exp_avg": 2e-2, "exp_avg_sq": 4e-2},
    # LoRA at learning rate 3e-2: B starts at zero, so AdamW's first updates move each element of B by about the
    # learning rate whatever the sign noise of its gradient; values and moments of the adapters differ by up to
    # 5.0e-5 and 6.9e-5 (2026-11-27, 2 blocks, FSDP 2 x TP 2), too close to the float32 ceilings of 1e-4. Gradient
    # norms, which expose a wrong reduction, keep theirs (worst 1.0e-6 of 2e-5).
    "single_process_lora": {**TOLERANCE, "param": 1e-3, "exp_avg": 1e-3, "exp_avg_sq": 1e-3},
}


@dataclass(frozen=True)
class Layout:
    name: str
    """test id"""
    nproc: int
    """ranks of the pool that runs it"""
    overrides: tuple[str, ...]
    """config overrides on top of the common ones"""
    reference: str = "single_process"
    """the 1-process layout whose results this one must match"""


def run_layout(argv: list[str], dump_folder: str, faults: tuple = (), expect: str = "success",
               fingerprints: bool = True) -> dict | None:
    """Train one layout on this rank; rank 0 returns {"metrics": [...], "params": [...], "grads": [...]} (per
    step; see tensor_fingerprints) and {"exp_avg": ..., "exp_avg_sq": ...} (AdamW's moments after the last step),
    the others None; a compiled layout adds how many graphs dynamo traced ("compiled_graphs").

    expect="setup_error": building the Trainer must fail with a one-line ValueError (as `run()` reports it);
    expect="training_error": training must stop with a TrainingError. Every rank then returns {"error": message}
    (and rank 0 the metrics logged until then) instead of raising, so the pool stays usable.
    fingerprints=False skips the per-tensor fingerprints (long runs that only read the metrics).
    """
    from torchtitan.components.step_guard import TrainingError
    from torchtitan.config.manager import load_config
    from torchtitan.distributed.utils import env_world
    from torchtitan.train import Trainer

    rank, _, world = env_world()
    cfg, resolved = load_config([*argv, "--job.dump_folder", dump_folder], world)
    params: list[dict] = []
    grads: list[dict] = []
    # The layout's process groups stay alive after it: DTensor caches sharding decisions per (equal) mesh, so a
    # later layout with an equal mesh reuses the groups an earlier one created (same ranks, same meaning), and
    # destroying them would leave those cache entries pointing at dead groups.
    try:
        trainer = Trainer(cfg, resolved, torch.device("cpu"))
    except ValueError as e:
        if expect == "setup_error":
            return {"error": str(e)}
        raise
    assert expect != "setup_error", "the layout was expected to fail during setup, but the Trainer was built"
    undo = [FAULTS[fault[0]](trainer, *fault[1:]) for fault in faults]
    if cfg.compile.enable:
        counters.clear()  # this layout's graphs only (the pool's ranks outlive layouts)
    # Frozen parameters (LoRA's base weights, norms, embeddings) get no gradient and must never change: their
    # fingerprints after every step are compared bit for bit with these (the same ranks sum them in the same order).
    frozen = frozen_names(trainer.model_parts)
    initial = tensor_fingerprints(trainer.model_parts, "param", only=frozen) if fingerprints and frozen else {}
    # The guard is asked after the gradient norm and before clipping: the gradients are then final and unclipped.
    should_step = trainer.guard.should_step

    def fingerprint_then_ask(local_loss_sum, grad_norm):
        grads.append(tensor_fingerprints(trainer.model_parts, "grad"))
        return should_step(local_loss_sum, grad_norm)

    if fingerprints:
        trainer.guard.should_step = fingerprint_then_ask
    result: dict[str, Any] = {}
    try:
        trainer.train(after_step=lambda step: params.append(tensor_fingerprints(trainer.model_parts, "param"))
                      if fingerprints else None)
    except TrainingError as e:
        if expect != "training_error":
            raise
        result["error"] = str(e)
    finally:
        for restore in undo:
            if restore is not None:  # the pool's next layout must run unmutated code
                restore()
    assert expect != "training_error" or "error" in result, "training was expected to stop with an error"
    moments = {of: tensor_fingerprints(trainer.model_parts, of, state=trainer.optimizer.state) for of in MOMENTS} \
        if fingerprints and "error" not in result else {}
    trainer.close()
    if rank != 0:
        return result or None
    metrics_file = Path(dump_folder) / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line] \
        if metrics_file.exists() else []
    graphs = {"compiled_graphs": counters["stats"]["unique_graphs"]} if cfg.compile.enable else {}
    return {**result, "metrics": metrics, "params": params, "grads": grads, **moments, "frozen": sorted(frozen),
            "initial": initial, **graphs}


def frozen_names(model_parts: list[torch.nn.Module]) -> set[str]:
    """The names of the parameters with requires_grad False on any rank (pipeline stages hold different ones)."""
    mine = {name for name, p in named_parameters(model_parts) if not p.requires_grad}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return set().union(*gathered)


def tensor_fingerprints(model_parts: list[torch.nn.Module], of: str, only: set[str] | None = None,
                        state: dict | None = None) -> dict[str, list[list[float]]]:
    """name -> the distinct fingerprints of every parameter (of="param"), its gradient (of="grad") or its optimizer
    state (of="exp_avg"/"exp_avg_sq", from `state`: the optimizer's, by parameter) over the job.

    A gradient's fingerprint is its L2 norm; a parameter's and a moment's are the norm and PROJECTIONS projections on
    fixed random vectors (one set per name), so a value in the wrong place shows even where whole-tensor sums would
    not.
    In float64. Each rank adds up the box of the whole tensor it holds (a shard, or all of it) and one all-gather per
    call merges the boxes by name: one copy of each box counts; a box held by several ranks whose copies differ
    (replicas that drifted apart: a missing reduction over tp or a replicate dimension) gives one more fingerprint per
    differing copy, each compared with the reference. `only`: these names alone.
    """
    mine: list[tuple[str, tuple, list[float]]] = []
    for name, p in named_parameters(model_parts):
        t = p if of == "param" else p.grad if of == "grad" else (state or {}).get(p, {}).get(of)
        if t is None or (only is not None and name not in only):
            continue
        local, (indices, box) = _local_elements(t)
        x = local.detach().to(torch.float64).flatten()
        sums = [x.square().sum().item()]
        if of != "grad":
            projections = _projections(name, tuple(t.shape)).reshape(PROJECTIONS, -1)
            sums += ((projections if indices is None else projections[:, indices]) @ x).tolist()
        mine.append((name, box, sums))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    boxes: dict[str, dict[tuple, list[list[float]]]] = {}
    for part in gathered:
        for name, box, sums in part:
            copies = boxes.setdefault(name, {}).setdefault(box, [])
            if sums not in copies:  # replicas compute bit-identical sums from equal values
                copies.append(sums)
    merged: dict[str, list[list[float]]] = {}
    for name, by_box in boxes.items():
        first = [sum(values) for values in zip(*(copies[0] for copies in by_box.values()), strict=True)]
        variants = [first] + [[total - a + b for total, a, b in zip(first, copies[0], other, strict=True)]
                              for copies in by_box.values() for other in copies[1:]]
        merged[name] = [[math.sqrt(max(v[0], 0.0)), *v[1:]] for v in variants]
    return merged


def _local_elements(t: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor | None, tuple]]:
    """(values, (indices, box)): the elements of the whole tensor this rank holds, their flat indices in it (None:
    all of it, in order) and a key equal on exactly the ranks that hold the same elements. A plain tensor and a
    replicated DTensor hold all of it; a sharded one, strided shards (FSDP over TP's dim) included, the elements its
    placements give, found by laying the whole tensor's indices out the same way (locally, without a collective).
    A partial value is not the value: it is reduced whole (a collective on its mesh, taken by every rank that holds
    it since the placements are the same there)."""
    if not isinstance(t, DTensor):
        return t, (None, ("all",))
    if any(pl.is_partial() for pl in t.placements):
        return t.full_tensor(), (None, ("all",))
    if all(pl.is_replicate() for pl in t.placements):
        return t.to_local(), (None, ("all",))
    key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
    if key not in _INDICES:
        whole = torch.arange(t.numel(), dtype=torch.int64).view(t.shape)
        indices = distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local().flatten()
        _INDICES[key] = (indices, (indices.numel(), zlib.crc32(indices.numpy().tobytes())))
    indices, box = _INDICES[key]
    local = t.to_local()
    assert local.numel() == indices.numel(), (t.shape, local.shape, t.placements)
    return local, (indices, box)


# Per (shape, mesh, placements): the flat indices of this rank's elements and their key (_local_elements).
_INDICES: dict[tuple, tuple[torch.Tensor, tuple]] = {}
PROJECTIONS = 2
_PROJECTIONS: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def _projections(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """PROJECTIONS standard normal tensors of `shape`, the same for a name in every process."""
    key = (name, shape)
    if key not in _PROJECTIONS:
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        _PROJECTIONS[key] = torch.randn(PROJECTIONS, *shape, generator=generator, dtype=torch.float64)
    return _PROJECTIONS[key]


def tensor_difference(got: list[float], ref: list[float]) -> float:
    """Relative difference of two fingerprints: about |got - ref| / |ref| of the tensors themselves (a projection
    on a unit-variance random vector moves by about the norm of the difference)."""
    scale = max(ref[0], 1e-30)
    return max(abs(g - r) for g, r in zip(got, ref, strict=True)) / scale


def tensor_differences(run: dict, reference: dict) -> dict[tuple[str, str], float]:
    """(kind, name) -> the largest relative difference of that tensor's fingerprints over the compared steps."""
    worst: dict[tuple[str, str], float] = {}
    kinds = [(of, run[kind], reference[kind]) for kind, of in (("grads", "grad"), ("params", "param"))]
    kinds += [(of, [run[of]], [reference[of]]) for of in MOMENTS if of in run and of in reference]
    for of, got_steps, ref_steps in kinds:
        for got, ref in zip(got_steps, ref_steps, strict=False):
            for name, (ref_values,) in ref.items():
                for copy in got.get(name, ()):
                    rel = tensor_difference(copy, ref_values)
                    worst[(of, name)] = max(worst.get((of, name), 0.0), rel)
    return worst


def compare(run: dict, reference: dict, tolerance: dict[str, float] = TOLERANCE, tensors: dict | None = None
            ) -> list[str]:
    """Every discrepancy beyond tolerance, worst first; empty when the run matches the reference. `tensors`:
    {"grad"|"param"|"exp_avg"|"exp_avg_sq": {name: tolerance}} for this reference (TENSOR_TOLERANCE[name])."""
    problems: list[tuple[float, str]] = []
    ref_metrics, got_metrics = reference["metrics"], run["metrics"]
    if [m["step"] for m in got_metrics] != [m["step"] for m in ref_metrics]:
        return [f"logged steps {[m['step'] for m in got_metrics]} != reference {[m['step'] for m in ref_metrics]}"]
    for got, ref in zip(got_metrics, ref_metrics, strict=True):
        for key in METRICS:
            if key in ref or key in got:
                if key not in got or key not in ref:
                    problems.append((math.inf, f"step {ref['step']}: {key} logged by only one of the runs"))
                    continue
                rel = abs(got[key] - ref[key]) / max(abs(ref[key]), 1e-12)
                if not rel <= tolerance[key]:
                    problems.append((rel, f"step {ref['step']}: {key} {got[key]!r} vs {ref[key]!r} (rel {rel:.2e})"))
    steps = [m["step"] for m in ref_metrics]
    problems += [(math.inf, text) for text in frozen_problems(run, reference, steps)]
    for kind, of in (("grads", "grad"), ("params", "param")):
        if len(run[kind]) != len(reference[kind]):
            problems.append((math.inf, f"{len(run[kind])} steps of {of} fingerprints vs {len(reference[kind])}"))
        for step, got, ref in zip(steps, run[kind], reference[kind], strict=False):
            problems += _tensor_problems(f"step {step}", of, got, ref, tolerance, tensors)
    for of in MOMENTS:
        if (of in run) != (of in reference):
            problems.append((math.inf, f"{of} fingerprinted in only one of the runs"))
        elif of in run:
            problems += _tensor_problems(f"after step {steps[-1] if steps else 0}", of, run[of], reference[of],
                                         tolerance, tensors)
    problems.sort(key=lambda p: -p[0])
    return [text for _, text in problems]


def _tensor_problems(when: str, of: str, got: dict, ref: dict, tolerance: dict[str, float], tensors: dict | None
                     ) -> list[tuple[float, str]]:
    """Each tensor's fingerprints against the reference's, at its own tolerance: tensors[of][name] or tolerance[of]."""
    problems = []
    if set(got) != set(ref):
        problems.append((math.inf, f"{when}: {of} names differ: {sorted(set(got) ^ set(ref))[:4]}"))
    for name, (ref_values,) in ref.items():  # the names both have still compared: each is its own symptom
        limit = (tensors or {}).get(of, {}).get(name, tolerance[of])
        for copy in got.get(name, ()):
            rel = tensor_difference(copy, ref_values)
            if not rel <= limit:
                what = {"grad": "gradient norm", "param": "values"}.get(of, of)
                copies = f" (one of {len(got[name])} differing copies)" if len(got[name]) > 1 else ""
                problems.append((rel, f"{when}: {name} {what} off by {rel:.2e} relative{copies}"))
    return problems


def frozen_problems(run: dict, reference: dict, steps: list[int]) -> list[str]:
    """A frozen parameter must be frozen in both runs, have no gradient, and keep its initial values exactly (its
    initial values are compared with the reference's like any parameter's, at every step)."""
    frozen, ref_frozen = set(run.get("frozen", ())), set(reference.get("frozen", ()))
    problems = [f"frozen in only one of the runs: {sorted(frozen ^ ref_frozen)[:4]}"] if frozen != ref_frozen else []
    for step, grads, params in zip(steps, run["grads"], run["params"], strict=False):
        if with_grad := sorted((frozen | ref_frozen) & set(grads)):
            problems.append(f"step {step}: frozen parameters have gradients: {with_grad[:4]}")
        if moved := sorted(name for name in frozen if params.get(name) != run.get("initial", {}).get(name)):
            problems.append(f"step {step}: frozen parameters changed: {moved[:4]}")
    return problems


def max_relative_differences(run: dict, reference: dict) -> dict[str, float]:
    """The largest relative difference of each kind: the noise floor when both runs are mathematically equal."""
    worst = dict.fromkeys(TOLERANCE, 0.0)
    for got, ref in zip(run["metrics"], reference["metrics"], strict=True):
        for key in METRICS:
            if key in ref:
                worst[key] = max(worst[key], abs(got[key] - ref[key]) / abs(ref[key]))
    for (of, _), rel in tensor_differences(run, reference).items():
        worst[of] = max(worst[of], rel)
    return worst


def from_step(run: dict, first: int) -> dict:
    """The steps >= first of a run (its metrics file may also hold the steps of the run it resumed), and its
    optimizer state after the last of them."""
    metrics = [m for m in run["metrics"] if m["step"] >= first]
    return {"metrics": metrics, "params": run["params"][-len(metrics):], "grads": run["grads"][-len(metrics):],
            **{of: run[of] for of in MOMENTS if of in run}}


def assert_continues_bitwise(resumed: dict, straight: dict, saved: int, steps: int) -> None:
    """A run resumed from the checkpoint of step `saved` trained steps saved+1..steps exactly as the straight run
    did: loss, gradient norm, validation loss and every parameter."""
    assert [m["step"] for m in resumed["metrics"]] == list(range(saved + 1, steps + 1)), f"must resume after {saved}"
    expected = from_step(straight, saved + 1)
    for got, ref in zip(resumed["metrics"], expected["metrics"], strict=True):
        assert (got["loss"], got["grad_norm"], got.get("val_loss")) == (ref["loss"], ref["grad_norm"],
                                                                         ref.get("val_loss")), (got, ref)
    assert resumed["params"] == expected["params"]
