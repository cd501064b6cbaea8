"""The tensor-parallel generator (torchtitan/rl/generator.py TPGenerator, torchtitan/distributed/generation_tp.py) on
forked gloo ranks: its completions and log-probabilities against LocalGenerator's on the whole model (Llama 3, Qwen3
with tied embeddings, DeepSeek-V3's MLA with and without the low-rank query), its KV cache and weights per rank, and
the weight sync from a training policy (TP 2, and FSDP 2 x TP 2 on 4 ranks) with the bytes it moves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.forked import run_ranks
from tests.unit.test_generation import sharpened
from torchtitan.distributed.generation_tp import generation_tp_errors
from torchtitan.generation import KVCache
from torchtitan.models.registry import get_model_spec
from torchtitan.rl.generator import LocalGenerator, SamplingParams, TPGenerator, sharded_state_dict

# Tiny 2-block models (dim 64, 4 heads): Llama's GQA (2 KV heads), Qwen3's QK-norm with tied embeddings, MLA with
# and without q-LoRA, all dense (the TP generator refuses MoE).
FAMILIES = {
    "llama3": ("llama3", "debugmodel_small", {}),
    "qwen3_tied": ("qwen3", "debugmodel_small", {"tie_word_embeddings": True}),
    "deepseek_v3": ("deepseek_v3", "debugmodel_small", {"n_dense_layers": 2}),
    "deepseek_v3_qlora": ("deepseek_v3", "debugmodel_small_qlora", {"n_dense_layers": 2}),
}
PROMPTS = [[5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 301], [400, 2, 77], [123, 45, 6, 7, 300, 1]]
GREEDY = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
SAMPLED = SamplingParams(n=3, max_new_tokens=8, temperature=1.0, top_p=0.9)
SEEDS = [11, 12, 13]


def _args(family: str):
    name, flavor, extra = FAMILIES[family]
    spec = get_model_spec(name)
    return spec, dataclasses.replace(spec.flavors[flavor], n_layers=2, max_seq_len=64, **extra)


def _whole(family: str) -> torch.nn.Module:
    """The same model in every process, with weights whose greedy continuations vary (at the plain init they repeat
    one token, which would hide a wrong head or a dropped past)."""
    return sharpened(*_args(family))


def _tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _completions(groups) -> list:
    return [[(c.tokens, c.logprobs, c.finish_reason) for c in group] for group in groups]


def _nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _generate_rank(rank: int, family: str) -> dict:
    spec, args = _args(family)
    with torch.device("meta"):
        model = spec.model_cls(args)
    gen = TPGenerator(model, _tp_mesh(), spec.tp_block_plan, device="cpu")
    whole = _whole(family)
    gen.update_weights(dict(whole.named_parameters()), version=1)  # whole tensors: each rank cuts its shard
    out = {"greedy": _completions(gen.generate(PROMPTS, GREEDY)), "cache_bytes": gen.cache_bytes,
           "param_bytes": _nbytes(gen.model), "sync_bytes": gen.last_sync.bytes_received}
    out["sampled"] = _completions(gen.generate(PROMPTS, SAMPLED, SEEDS))
    # The cache as the model fills it: this rank's heads (MLA: the latent every head shares).
    cache = KVCache(torch.zeros(1, dtype=torch.long), 8)
    gen.model(torch.tensor([PROMPTS[0][:4]]), cache=cache)
    out["cache_shapes"] = [tuple(b.shape) for b in cache.layer("0").buffers]
    # A materialised whole model is cut in place (its tie kept): the same tokens without an update_weights.
    cut = TPGenerator(_whole(family), _tp_mesh(), spec.tp_block_plan)
    out["cut_greedy"] = _completions(cut.generate(PROMPTS, GREEDY))
    out["cut_params"] = len(list(cut.model.parameters())) == len(list(whole.parameters()))
    try:  # tp ranks handed different prompts must stop with an error, not hang in a collective
        gen.generate([PROMPTS[rank]], GREEDY)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


_RESULTS: dict[str, list] = {}


def _tp_results(family: str) -> list[dict]:
    if family not in _RESULTS:
        _RESULTS[family] = run_ranks(_generate_rank, family, world=2)
    return _RESULTS[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_completions_equal_local_generator(family: str) -> None:
    """Greedy and seeded top-p sampling on TP 2: every rank returns LocalGenerator's token ids on the whole model
    (same stop reasons), log-probabilities within 1e-5, and the two ranks agree bit for bit."""
    results = _tp_results(family)
    local = LocalGenerator(_whole(family))
    want = {"greedy": _completions(local.generate(PROMPTS, GREEDY)),
            "sampled": _completions(local.generate(PROMPTS, SAMPLED, SEEDS))}
    assert len({tok for group in want["greedy"] for c in group for tok in c[0]}) > 3  # continuations vary
    for kind in ("greedy", "sampled"):
        assert results[0][kind] == results[1][kind], kind  # the tp ranks sampled the same tokens
        for got_group, want_group in zip(results[0][kind], want[kind], strict=True):
            for (tokens, logprobs, reason), (want_tokens, want_logprobs, want_reason) in zip(got_group, want_group,
                                                                                            strict=True):
                assert (tokens, reason) == (want_tokens, want_reason), kind
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=0, atol=1e-5)
    for out in results:
        assert out["cut_greedy"] == out["greedy"] and out["cut_params"]
        assert out["sync_bytes"] == 0  # whole tensors are cut locally
        assert "different prompts" in out["mismatch"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_holds_local_heads_and_shards(family: str) -> None:
    """Per rank: the KV cache holds this rank's KV heads (half of LocalGenerator's cache for Llama and Qwen3; MLA's
    shared latent is whole on each rank), and the weights are half the model's but for the replicated norms (and
    MLA's low-rank projections)."""
    results = _tp_results(family)
    whole = _whole(family)
    local = LocalGenerator(whole)
    local.generate(PROMPTS, GREEDY)
    _, args = _args(family)
    mla = family.startswith("deepseek")
    for out in results:
        if mla:
            assert out["cache_bytes"] == local.cache_bytes
            assert out["cache_shapes"] == [(1, 8, args.kv_lora_rank + args.qk_rope_head_dim)]
        else:
            assert out["cache_bytes"] * 2 == local.cache_bytes
            assert out["cache_shapes"] == [(1, args.num_kv_heads // 2, 8, args.head_dim)] * 2
        replicated = sum(p.numel() * 4 for name, p in whole.named_parameters()
                         if name.endswith("norm.weight") or ".wq_a." in name or ".wkv_a." in name)
        assert out["param_bytes"] == (_nbytes(whole) - replicated) // 2 + replicated


def test_moe_and_indivisible_shapes_are_refused() -> None:
    spec = get_model_spec("qwen3")
    with torch.device("meta"):
        moe = spec.model_cls(dataclasses.replace(spec.flavors["debugmodel_moe_small"], n_layers=2))
        dense = spec.model_cls(dataclasses.replace(spec.flavors["debugmodel_small"], n_layers=2))
    errors = generation_tp_errors(moe, 2)
    assert len(errors) == 1 and "does not support MoE layers (layers 0, 1)" in errors[0], errors
    assert generation_tp_errors(dense, 2) == []
    assert any("n_kv_heads=2 is not divisible" in e for e in generation_tp_errors(dense, 4))


def test_split_follows_the_training_plan_and_refuses_what_it_cannot_place() -> None:
    from torchtitan.distributed.generation_tp import COLS, ROWS, _plan

    spec, args = _args("qwen3_tied")
    with torch.device("meta"):
        model = spec.model_cls(args)
    dims, rowwise = _plan(model, spec.tp_block_plan)
    assert rowwise == [f"layers.{i}.{m}" for i in "01" for m in ("attention.wo", "feed_forward.w2")]
    assert dims["layers.1.attention.wk.weight"] == dims["layers.0.feed_forward.w3.weight"] == ROWS
    assert dims["layers.0.feed_forward.w2.weight"] == COLS and dims["tok_embeddings.weight"] == ROWS
    assert dims["layers.0.attention.q_norm.weight"] is None and dims["norm.weight"] is None
    # a parameter nested in a split module (an adapter, say) has no split of its own: refused, never replicated
    with torch.device("meta"):
        model.layers["1"].attention.wq.adapter = torch.nn.Linear(64, 4, bias=False)
    with pytest.raises(ValueError, match="no placement for parameter layers.1.attention.wq.adapter.weight"):
        _plan(model, spec.tp_block_plan)


class _Collectives(TorchDispatchMode):
    """Records every functional collective (DTensor's redistribute issues them) with its output's bytes."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name != "wait_tensor" and not name.startswith("_"):
            self.calls.append((name, out.numel() * out.element_size()))
        return out


def _sync_rank(rank: int, dp_shard: int) -> dict:
    """A training policy (Llama, the trainer's own parallelize: TP 2 with sequence and loss parallel, FSDP over
    dp_shard when > 1), seeded as the trainer seeds it, synced into a TPGenerator over its tp mesh."""
    from torchtitan.components.model_parts import materialize
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import param_init

    spec, args = _args("llama3")
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=2, pp=1, ep=1, world_size=2 * dp_shard)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        policy = spec.parallelize_fn(spec.model_cls(args), dims, JobConfig(), "float32")
    materialize([policy], torch.device("cpu"), 7, param_init)
    with torch.device("meta"):
        model = spec.model_cls(args)
    gen = TPGenerator(model, dims.mesh("tp"), spec.tp_block_plan, device="cpu")
    with _Collectives() as log:
        gen.update_weights(sharded_state_dict([policy]), version=3)
    return {"shards": {name: p for name, p in gen.model.named_parameters()}, "calls": log.calls,
            "stats": dataclasses.asdict(gen.last_sync), "tp_rank": dims.mesh("tp").get_local_rank(),
            "greedy": _completions(gen.generate(PROMPTS[:2], SamplingParams(n=1, max_new_tokens=4, temperature=0.0)))}


@pytest.mark.parametrize("dp_shard", [1, 2], ids=["tp2", "fsdp2_tp2"])
def test_sync_writes_the_policy_tp_shards_gathering_only_over_dp(dp_shard: int) -> None:
    """After update_weights each generator rank holds its tp shard of the policy: the shards of a tp pair put
    together equal a one-process model of the same seed, which then generates the same tokens. A TP-only policy
    moves nothing; under FSDP 2 x TP 2 each parameter is one all-gather over dp whose output is the rank's tp shard
    (never the whole tensor), and each rank receives half of its shards' bytes."""
    from torchtitan.components.model_parts import materialize
    from torchtitan.distributed.utils import param_init

    results = run_ranks(_sync_rank, dp_shard, world=2 * dp_shard)
    spec, args = _args("llama3")
    with torch.device("meta"):
        whole = spec.model_cls(args)
    materialize([whole], torch.device("cpu"), 7, param_init)
    want_greedy = _completions(LocalGenerator(whole).generate(PROMPTS[:2], SamplingParams(n=1, max_new_tokens=4,
                                                                                       temperature=0.0)))
    split = {"tok_embeddings.weight": 0, "output.weight": 0, "attention.wo.weight": 1, "feed_forward.w2.weight": 1,
             "attention.wq.weight": 0, "attention.wk.weight": 0, "attention.wv.weight": 0,
             "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0}
    for first in range(0, len(results), 2):  # ranks (2i, 2i + 1) are one tp pair
        pair = sorted(results[first:first + 2], key=lambda r: r["tp_rank"])
        for name, p in whole.named_parameters():
            dim = next((d for suffix, d in split.items() if name.endswith(suffix)), None)
            shards = [torch.tensor(r["shards"][name]) for r in pair]
            got = shards[0] if dim is None else torch.cat(shards, dim=dim)
            assert torch.equal(got, p.detach()), name
            if dim is None:
                assert torch.equal(shards[1], p.detach()), name
    shard_bytes = sum(torch.tensor(v).numel() * 4 for v in results[0]["shards"].values())
    for out in results:
        assert out["greedy"] == want_greedy
        if dp_shard == 1:
            assert out["calls"] == [] and out["stats"]["bytes_received"] == 0
        else:
            assert {name for name, _ in out["calls"]} == {"all_gather_into_tensor"}
            assert len(out["calls"]) == out["stats"]["params"] == out["stats"]["gathered"] == len(out["shards"])
            assert sum(b for _, b in out["calls"]) == shard_bytes  # each gather's output is a tp shard
            assert out["stats"]["bytes_received"] * 2 == shard_bytes
