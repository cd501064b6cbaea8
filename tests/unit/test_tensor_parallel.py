"""Tensor parallel: gradients equal the 1-process gradients (forked gloo ranks), and invalid layouts fail early."""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.unit.forked import run_ranks
from tests.unit.test_config import run_train_in_child
from torchtitan.components.loss import cross_entropy_sum
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import load_config
from torchtitan.config.validate import tp_divisibility_errors
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.tensor_parallel import apply_tp, local_value, loss_parallel_context
from torchtitan.distributed.utils import clip_grad_norm_, param_init
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import tp_block_plan

SEQ = 32


def _args(flavor: str = "debugmodel", **kw):
    return dataclasses.replace(llama3_flavors[flavor], n_layers=2, max_seq_len=SEQ, **kw)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 8192, (2, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100  # ignored targets must be ignored on every vocab shard
    return tokens[:, :-1], labels


def _reference(flavor: str) -> tuple[float, float, dict[str, torch.Tensor]]:
    with torch.device("meta"):
        model = Transformer(_args(flavor))
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # as in _tp_rank: the same draws, in the same order, after construction
    model.init_weights(buffer_device=torch.device("cpu"))
    inputs, labels = _batch()
    loss = cross_entropy_sum(model(inputs), labels)
    loss.backward()
    # fp64: a 1-thread CPU fp32 norm of the 2M-element output gradient is itself off by ~1e-4 relative.
    norm = torch.nn.utils.get_total_norm([p.grad.double() for p in model.parameters()])
    return loss.item(), norm.item(), {n: p.grad for n, p in model.named_parameters()}


def _tp_rank(rank: int, flavor: str, loss_parallel: bool, ac: str, compiled: bool) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = Transformer(_args(flavor))
    apply_tp(model, mesh, loss_parallel=loss_parallel, block_plan=tp_block_plan())
    apply_ac(model, "selective" if ac == "op" else ac, "op")
    if compiled:
        apply_compile(model, "inductor")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"), param_init=param_init)
    inputs, labels = _batch()
    logits = model(inputs)
    assert isinstance(logits, DTensor) == loss_parallel
    with loss_parallel_context(loss_parallel):
        loss = cross_entropy_sum(logits, labels)
        loss.backward()
    norm = clip_grad_norm_(model.parameters(), max_norm=0.0)
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"loss": local_value(loss).item(), "norm": norm.item(), "grads": grads,
            "tied": model.output.weight is model.tok_embeddings.weight}


CASES = [
    ("debugmodel", True, "none", False),
    ("debugmodel", False, "none", False),
    ("debugmodel_tied", True, "none", False),
    ("debugmodel", True, "op", False),
    ("debugmodel", True, "full", False),
    # compile with TP is covered by the tp2_compile integration flavor (a cold compile costs ~30 s here)
]


def _tp_cases(rank: int, cases: list[tuple]) -> list[dict]:
    """Every case on these two ranks, each checked here against the 1-process reference (computed on the rank, once
    per flavor): per parameter only the largest difference and the reference's largest value travel back, not the
    5.8M-element gradients (shipping them as lists cost more than the forward and backward). A case that raises
    reports its traceback and the next case still runs."""
    refs: dict[str, tuple] = {}
    out = []
    for case in cases:
        try:
            flavor = case[0]
            if flavor not in refs:
                refs[flavor] = _reference(flavor)
            ref_loss, ref_norm, ref_grads = refs[flavor]
            got = _tp_rank(rank, *case)
            diffs = {name: ((got["grads"][name] - g).abs().max().item(), g.abs().max().item())
                     for name, g in ref_grads.items() if name in got["grads"]}
            out.append({"loss": got["loss"], "norm": got["norm"], "tied": got["tied"], "names": sorted(got["grads"]),
                        "ref_loss": ref_loss, "ref_norm": ref_norm, "ref_names": sorted(ref_grads), "diffs": diffs,
                        "error": None})
        except Exception:
            out.append({"error": traceback.format_exc()})
    return out


@pytest.fixture(scope="module")
def tp_results() -> dict[tuple, list[dict]]:
    """All cases in one pair of forked ranks: one fork and one process group instead of one per case, and DTensor's
    sharding caches warm after the first case."""
    per_rank = run_ranks(_tp_cases, CASES, timeout=300)
    return {case: [results[i] for results in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.parametrize(("flavor", "loss_parallel", "ac", "compiled"), CASES)
def test_tp2_matches_single_process(tp_results, flavor, loss_parallel, ac, compiled):
    for out in tp_results[(flavor, loss_parallel, ac, compiled)]:
        assert out["error"] is None, out["error"]
        assert out["tied"] == (flavor == "debugmodel_tied")
        assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-6)
        # fp32 accumulation error only (see _reference); the exact reduction is tested on fp64 DTensors below
        assert out["norm"] == pytest.approx(out["ref_norm"], rel=5e-4)
        assert out["names"] == out["ref_names"]
        for name, (diff, ref_max) in out["diffs"].items():
            assert diff <= 1e-5 * ref_max, (name, diff)


def _clip_rank(rank: int) -> list[float]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = [torch.arange(1.0, 13.0, dtype=torch.float64).view(4, 3) * (i + 1) for i in range(3)]
    grads = [
        DTensor.from_local(full[0].chunk(2)[rank], mesh, [Shard(0)]),  # column-wise weight
        DTensor.from_local(full[1], mesh, [Replicate()]),  # replicated weight, already reduced
        DTensor.from_local(full[2] * (0.25 if rank == 0 else 0.75), mesh, [Partial()]),  # SP norm weight
    ]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    norm = clip_grad_norm_(params, max_norm=1.0).item()
    return [norm, *(p.grad.full_tensor().norm().item() for p in params)]


def test_clip_reduces_every_placement_exactly():
    full = [torch.arange(1.0, 13.0, dtype=torch.float64).view(4, 3) * (i + 1) for i in range(3)]
    expected = torch.cat([f.flatten() for f in full]).norm().item()
    for norm, *after in run_ranks(_clip_rank):
        assert norm == pytest.approx(expected, rel=1e-12)
        scale = 1.0 / (expected + 1e-6)
        for f, got in zip(full, after, strict=True):
            assert got == pytest.approx(f.norm().item() * scale, rel=1e-9)


def test_cross_entropy_sum_matches_mean_times_count():
    inputs, labels = _batch()
    logits = torch.randn(*labels.shape, 8192)
    n = (labels != -100).sum()
    assert cross_entropy_sum(logits, labels).item() == pytest.approx(
        (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) * n).item(), rel=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"dim": 192, "n_heads": 6, "n_kv_heads": 6}, "n_heads=6 is not divisible"),
    ({"n_kv_heads": 1}, "n_kv_heads=1 is not divisible by tensor_parallel_degree=4 (GQA"),
    ({"vocab_size": 8190}, "vocab_size=8190"),
])
def test_divisibility_errors_name_the_problem(change, message):
    errors = tp_divisibility_errors(dataclasses.replace(llama3_flavors["debugmodel"], **change), 4, {})
    assert any(message in e for e in errors), errors


def test_valid_layout_has_no_errors():
    assert tp_divisibility_errors(llama3_flavors["8B"], 8, {"training.seq_len": 8192}) == []
    assert tp_divisibility_errors(llama3_flavors["debugmodel"], 1, {"training.seq_len": 7}) == []


@pytest.mark.parametrize(("args", "message"), [
    (["--parallelism.tensor_parallel_degree", "8"], "n_kv_heads=4 is not divisible by tensor_parallel_degree=8"),
    (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
     "training.seq_len=63 is not divisible by tensor_parallel_degree=2"),
    (["--parallelism.tensor_parallel_degree", "2", "--validation.enable", "--validation.seq_len", "33"],
     "validation.seq_len=33"),
    (["--parallelism.enable_async_tensor_parallel"], "needs parallelism.tensor_parallel_degree > 1"),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"],
     "needs compile.enable = true"),
    (["--compile.components", "model,optimizer"], "compile.components: unknown entries ['optimizer']"),
])
def test_invalid_tp_config_is_one_line_error(args, message):
    # load_config: the validation.seq_len check reads the resolved value, so it runs in resolve
    with pytest.raises(ConfigError) as e:
        load_config(args, world_size=8)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_async_tp_on_cpu_fails_before_process_group(tmp_path):
    # WORLD_SIZE=2 without a launcher: the check must fire before init_process_group would wait for rank 1 (the
    # tripwires end the run at once if it does not).
    code, err = run_train_in_child(["--parallelism.tensor_parallel_degree", "2",
                                    "--parallelism.enable_async_tensor_parallel", "--compile.enable",
                                    "--job.dump_folder", str(tmp_path)], tmp_path,
                                   WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="")
    assert code == 2, err[-2000:]
    assert "parallelism.enable_async_tensor_parallel: needs CUDA GPUs" in err
