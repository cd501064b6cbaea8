"""LoRA (torchtitan/components/quantization/lora.py, lora_export.py): the adapter's math, freezing, layouts
(FSDP, TP against one process), the merged and PEFT exports, and the memory estimator's frozen parameters."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from tests.unit.forked import in_child, run_ranks
from torchtitan.components.model_parts import materialize, model_args_for, named_parameters
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.quantization import lora, lora_export
from torchtitan.components.step import forward_backward_step
from torchtitan.config.manager import load_config, parse_args
from torchtitan.distributed import utils as dist_utils
from torchtitan.estimation.engine import build_parallel_model, estimate_rank
from torchtitan.models.registry import get_model_spec

SEQ, BATCH, STEPS = 32, 4, 2
BASE = ["--model.flavor", "debugmodel_small", "--training.seq_len", str(SEQ), "--training.local_batch_size",
        str(BATCH), "--training.max_norm", "1.0", "--optimizer.lr", "1e-2"]
# one column-wise (wq, w1) and one row-wise (wo, w2) projection of each kind get adapters
LORA = [*BASE, "--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8",
        "--lora.target_modules", "wq,wo,w1,w2"]


def _parts(argv: list[str], world: int = 1):
    """The trainer's model parts, materialised; one process (world 1) without a process group: the model and its
    converter only, which is all the parallelize function would apply there."""
    cfg, resolved = load_config(argv, world)
    if world == 1:
        model_args = model_args_for(cfg)
        with torch.device("meta"):
            model = get_model_spec(cfg.model.name).model_cls(model_args)
        if "lora" in cfg.model.converters:
            lora.convert(model, cfg)
        parts, loss_parallel = [model], False
    else:
        parts, model_args, loss_parallel = build_parallel_model(cfg, resolved.parallel_dims, "cpu")
    materialize(parts, torch.device("cpu"), 0, dist_utils.param_init)
    return cfg, resolved, parts, model_args, loss_parallel


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"tokens": torch.randint(0, vocab, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, vocab, (BATCH, SEQ), generator=g)}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(rank: int, argv: list[str], world: int) -> dict:
    """STEPS steps on one fixed global batch (each data-parallel rank its rows); the summed loss, the adapters'
    gradients after the last step, and whether the frozen parameters stayed bit-identical."""
    cfg, resolved, parts, model_args, loss_parallel = _parts(argv, world)
    dims = resolved.parallel_dims
    dp, dp_rank = (dims.dp_shard, dims.mesh("dp_shard").get_local_rank()) if dims.dp_shard > 1 else (1, 0)
    batch = {k: v.chunk(dp)[dp_rank] for k, v in _batch(model_args.vocab_size).items()}
    optimizer = OptimizersContainer(parts, cfg.optimizer, "cpu")
    frozen = {n: _full(p) for n, p in named_parameters(parts) if not p.requires_grad}
    losses, norms = [], []
    for _ in range(STEPS):
        loss, norm = forward_backward_step(parts, optimizer, [batch], torch.tensor(BATCH * SEQ), max_norm=1.0,
                                           device=torch.device("cpu"), loss_parallel=loss_parallel)
        if dp > 1:
            torch.distributed.all_reduce(loss)
        losses.append(float(loss) / (BATCH * SEQ))
        norms.append(float(norm))
    named = named_parameters(parts)
    return {
        "losses": losses, "norms": norms,
        "grads": {n: _full(p.grad) for n, p in named if p.requires_grad},
        "adapters": {n: _full(p) for n, p in named if p.requires_grad},
        "frozen_unchanged": all(torch.equal(_full(p), frozen[n]) for n, p in named if not p.requires_grad),
        "frozen_have_grad": [n for n, p in named if not p.requires_grad and p.grad is not None],
        "optimizer_state": sorted(n for n, p in named if any(p in o.state for o in optimizer.optimizers)),
    }


# --------------------------------------------------------------------------- the layer and the converter


def test_lora_linear_equals_explicit_weight_plus_scaled_product():
    torch.manual_seed(0)
    base = nn.Linear(16, 12, bias=False)
    layer = lora.LoRALinear.wrap(base, rank=3, alpha=6.0, dropout=0.0)
    assert layer.weight is base.weight and layer.scale == 2.0
    with torch.no_grad():
        layer.lora_a.normal_()
        layer.lora_b.normal_()
    x = torch.randn(5, 7, 16)
    w = base.weight + 2.0 * layer.lora_b @ layer.lora_a
    torch.testing.assert_close(layer(x), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.merged_weight(), w.detach())


def test_init_is_b_zero_a_kaiming_uniform_and_logits_equal_the_base_model():
    _, _, parts, _, _ = _parts(LORA)
    _, _, (base,), args, _ = _parts(BASE)
    model = parts[0]
    wrapped = lora_export.lora_modules(parts)
    assert sorted({n.rsplit(".", 1)[-1] for n in wrapped}) == ["w1", "w2", "wo", "wq"]
    assert len(wrapped) == 4 * args.n_layers
    for m in wrapped.values():
        assert torch.count_nonzero(m.lora_b) == 0
        bound = 1 / math.sqrt(m.in_features)
        assert m.lora_a.abs().max() <= bound and m.lora_a.std() > bound / 3  # U(-bound, bound) has std bound/1.73
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    # every base parameter is the base model's own (seeded by name), so the logits match exactly
    own = dict(base.named_parameters())
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters() if not p.requires_grad)
    tokens = _batch(args.vocab_size)["tokens"]
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))


def test_all_linear_never_wraps_the_output_projection():
    _, _, parts, args, _ = _parts([*BASE, "--model.converters", "lora", "--lora.target_modules", "all-linear"])
    names = lora_export.lora_modules(parts)
    assert len(names) == 7 * args.n_layers and not any(n.startswith("output") for n in names)


def test_unknown_target_module_is_an_error():
    with pytest.raises(ValueError, match="lora.target_modules"):
        _parts([*BASE, "--model.converters", "lora", "--lora.target_modules", "q_proj"])


def test_training_moves_only_adapters():
    got = _train(0, LORA, 1)
    assert got["frozen_unchanged"] and not got["frozen_have_grad"]
    assert set(got["optimizer_state"]) == set(got["adapters"])
    assert all(n.endswith(("lora_a", "lora_b")) for n in got["adapters"])
    assert all(torch.count_nonzero(g) for g in got["grads"].values())
    assert got["losses"][1] < got["losses"][0]


# --------------------------------------------------------------------------- layouts against one process


def _layouts(rank: int, layouts: list[list[str]], world: int) -> list[dict]:
    return [_train(rank, argv, world) for argv in layouts]


def test_fsdp_and_tp_match_one_process():
    ref = _train(0, LORA, 1)
    layouts = [[*LORA, "--parallelism.data_parallel_shard_degree", "2"],
               [*LORA, "--parallelism.tensor_parallel_degree", "2"]]
    fsdp, tp = run_ranks(_layouts, layouts, 2, world=2, timeout=120)[0]
    for got in (fsdp, tp):
        assert got["frozen_unchanged"] and not got["frozen_have_grad"]
        for a, b in zip(got["losses"], ref["losses"], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        for a, b in zip(got["norms"], ref["norms"], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        assert got["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            torch.testing.assert_close(torch.tensor(got["grads"][name]), g, rtol=1e-5, atol=1e-7, msg=name)
        # AdamW's first steps move every element by about lr whatever its gradient's size: an element whose gradient
        # is ~0 may move differently by rounding. 1e-4 is 1% of one step (lr 1e-2).
        for name, a in ref["adapters"].items():
            torch.testing.assert_close(torch.tensor(got["adapters"][name]), a, rtol=1e-5, atol=1e-4, msg=name)


def _tp_placements(rank: int) -> dict:
    _, _, parts, _, _ = _parts([*LORA, "--parallelism.tensor_parallel_degree", "2"], 2)
    block = parts[0].layers["0"]
    return {f"{m}.{p}": str(getattr(block.get_submodule(m), p).placements[0])
            for m in ("attention.wq", "attention.wo") for p in ("weight", "lora_a", "lora_b")}


def test_tp_places_adapters_by_the_base_style():
    got = run_ranks(_tp_placements, world=2, timeout=60)[0]
    assert got == {"attention.wq.weight": "S(0)", "attention.wq.lora_a": "R", "attention.wq.lora_b": "S(0)",
                   "attention.wo.weight": "S(1)", "attention.wo.lora_a": "S(1)", "attention.wo.lora_b": "R"}


# --------------------------------------------------------------------------- exports


def _trained_model():
    cfg, _, parts, args, _ = _parts([*LORA, "--lora.target_modules", "all-linear"])
    optimizer = OptimizersContainer(parts, cfg.optimizer, "cpu")
    for _ in range(STEPS):
        forward_backward_step(parts, optimizer, [_batch(args.vocab_size)], torch.tensor(BATCH * SEQ), max_norm=1.0,
                              device=torch.device("cpu"))
    return parts, args


def test_merged_export_and_peft_adapters_give_our_logits_and_gradients(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torchtitan.components.hf_io import save_hf

    parts, args = _trained_model()
    model = parts[0]
    tokens = _batch(args.vocab_size)["tokens"]
    with torch.no_grad():
        ours = model(tokens)
    merged = lora_export.merged_state_dict(parts)
    assert not any(lora.is_adapter(k) for k in merged)
    _, _, (plain,), _, _ = _parts(BASE)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), ours, rtol=1e-5, atol=1e-5)

    base_sd = {k: v for k, v in model.state_dict().items() if not lora.is_adapter(k)}
    save_hf(tmp_path / "base", base_sd, args, model="llama3")
    peft_dir = lora_export.save_peft(tmp_path / "peft", parts, args, model="llama3", base_model_name_or_path="base")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, peft_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours, rtol=1e-4, atol=1e-4)
    save_hf(tmp_path / "merged", merged, args, model="llama3")
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf_merged(tokens).logits, ours, rtol=1e-4, atol=1e-4)

    # Gradients: PEFT's LoRA on transformers' model against ours, for the same loss, every A and B (ours mapped to
    # PEFT's names and row order by the export itself).
    labels = _batch(args.vocab_size)["labels"]
    trainable = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32), peft_dir,
        is_trainable=True)
    logits = trainable(tokens).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    model.zero_grad(set_to_none=True)
    model(tokens, labels=labels).backward()
    adapters = lora_export.adapter_tensors(parts)
    values = {name: (m.lora_a.detach().clone(), m.lora_b.detach().clone()) for name, (_, _, m) in adapters.items()}
    with torch.no_grad():  # the export's mapping applied to the gradients: put them where the adapters are
        for _, _, m in adapters.values():
            m.lora_a.copy_(m.lora_a.grad)
            m.lora_b.copy_(m.lora_b.grad)
        ours_mapped = {k: v.clone() for k, v in lora_export.peft_state(parts, args, model="llama3")[0].items()}
        for name, (a, b) in values.items():
            adapters[name][2].lora_a.copy_(a)
            adapters[name][2].lora_b.copy_(b)
    theirs = {n.replace(".default.weight", ".weight"): p.grad for n, p in trainable.named_parameters()
              if "lora_" in n}
    assert theirs.keys() == ours_mapped.keys() and len(theirs) == 2 * 28  # A and B of 28 layers
    for name, grad in ours_mapped.items():
        torch.testing.assert_close(theirs[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------- memory estimator


def _estimate(argv: list[str]):
    cfg = parse_args(argv)
    est = estimate_rank(cfg, 1, 0, "cpu")
    _, _, parts, _, _ = _parts(argv)
    trainable = sum(p.numel() for p in parts[0].parameters() if p.requires_grad)
    total = sum(p.numel() for p in parts[0].parameters())
    return est.steady_bytes, est.counts, trainable, total


def test_estimator_counts_gradients_and_optimizer_state_for_adapters_only():
    steady, counts, trainable, total = in_child(_estimate, LORA)
    assert trainable < total / 10
    assert counts["trainable_parameters"] == trainable and counts["parameters"] == total
    assert steady["parameters"] == 4 * total
    assert steady["gradients"] == 4 * trainable  # fp32, adapters only
    assert steady["optimizer_state"] >= 8 * trainable and steady["optimizer_state"] < 8 * trainable + 1024
