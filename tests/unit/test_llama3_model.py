"""Unit tests for the Llama 3 model: published sizes, init contract, RoPE, attention, pipeline cuts."""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.llama3.args import (
    RoPEScaling,
    TransformerModelArgs,
    llama3_flavors,
)
from torchtitan.models.llama3.model import (
    Attention,
    RMSNorm,
    Transformer,
    apply_rotary_emb,
    get_nparams_and_flops,
    precompute_freqs_cis,
    rope_frequencies,
)

PUBLISHED_PARAMS = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}

MODEL_SOURCE = Path(__file__).resolve().parents[2] / "torchtitan" / "models" / "llama3" / "model.py"


def _debug_args(**overrides: object) -> TransformerModelArgs:
    # Short rotary table keeps the tests fast; everything else is the real debugmodel.
    return dataclasses.replace(llama3_flavors["debugmodel"], max_seq_len=64, **overrides)


def _build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    """The trainer's path: construct on meta, materialise, then initialise."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def debug_model() -> Transformer:
    return _build(_debug_args())


def _tokens(batch: int = 2, seq: int = 16, vocab: int = 8192, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


# ----------------------------------------------------------------------------- sizes and names


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts(flavor: str) -> None:
    args = llama3_flavors[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    nparams, flops = get_nparams_and_flops(model, args, seq_len=8192)
    assert nparams == PUBLISHED_PARAMS[flavor]
    assert flops > 6 * nparams - 6 * args.vocab_size * args.dim


def test_flavor_keys_and_ffn_sizes() -> None:
    assert set(llama3_flavors) == {"debugmodel", "debugmodel_tied", "debugmodel_small", "debugmodel_small_tied",
                                   "debugmodel_vocab2k", "1B", "3B", "8B", "8B_8blocks", "70B", "405B"}
    assert llama3_flavors["debugmodel_tied"].tie_word_embeddings
    # the benchmark flavor: the 8B block shape, 8 blocks
    assert llama3_flavors["8B_8blocks"] == dataclasses.replace(llama3_flavors["8B"], n_layers=8)
    # the memory estimator's accuracy model: the debug model but for its vocabulary
    assert llama3_flavors["debugmodel_vocab2k"] == dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=2048)
    expected_hidden = {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}
    for name, hidden in expected_hidden.items():
        assert llama3_flavors[name].ffn_hidden_dim == hidden
    assert llama3_flavors["1B"].tie_word_embeddings and not llama3_flavors["8B"].tie_word_embeddings
    debug = llama3_flavors["debugmodel"]
    assert debug.vocab_size == 8192 and debug.num_kv_heads < debug.n_heads and debug.rope_scaling is not None


def test_submodule_names_are_the_contract(debug_model: Transformer) -> None:
    names = {n for n, _ in debug_model.named_parameters()}
    assert "tok_embeddings.weight" in names and "norm.weight" in names and "output.weight" in names
    for i in range(4):
        for sub in (
            "attention_norm",
            "ffn_norm",
            *(f"attention.w{x}" for x in "qkvo"),
            *(f"feed_forward.w{x}" for x in "123"),
        ):
            assert f"layers.{i}.{sub}.weight" in names
    assert not any(n.endswith(".bias") for n in names)
    # freqs_cis is derived from the config, so it must not end up in checkpoints.
    assert "freqs_cis" not in debug_model.state_dict()
    assert "freqs_cis" in dict(debug_model.named_buffers())


def test_model_does_not_import_distributed() -> None:
    source = MODEL_SOURCE.read_text()
    assert "torch.distributed" not in source
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("torch.distributed")
            assert not (node.module == "torch" and any(a.name == "distributed" for a in node.names))


# ----------------------------------------------------------------------------- init


def test_init_gives_finite_values_and_forward_shape(debug_model: Transformer) -> None:
    for name, p in debug_model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert debug_model.freqs_cis.shape == (64, 16, 2)
    assert torch.isfinite(debug_model.freqs_cis).all()
    with torch.no_grad():
        logits = debug_model(_tokens())
    assert logits.shape == (2, 16, 8192)
    assert torch.isfinite(logits).all()


def test_init_std_scheme() -> None:
    model = _build(_debug_args(n_layers=4, dim=512, n_heads=8, n_kv_heads=4))
    assert model.layers["0"].attention_norm.weight.eq(1).all() and model.norm.weight.eq(1).all()
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert model.layers["2"].attention.wq.weight.std().item() == pytest.approx(0.02 * 0.986, rel=0.03)
    for layer_id in (0, 3):
        expected = 0.02 / math.sqrt(2 * (layer_id + 1)) * 0.986  # 0.986: trunc at +-3 std
        assert model.layers[str(layer_id)].feed_forward.w2.weight.std().item() == pytest.approx(expected, rel=0.03)
    out = model.output.weight
    assert out.abs().max().item() <= 3 * 512**-0.5 + 1e-6
    flat = _build(_debug_args(depth_init=False))
    assert flat.layers["0"].weight_init_std == flat.layers["3"].weight_init_std == 0.02 / math.sqrt(8)


def test_param_init_sees_every_parameter_once_in_order() -> None:
    for tie in (False, True):
        with torch.device("meta"):
            model = Transformer(_debug_args(tie_word_embeddings=tie))
        model.to_empty(device="cpu")
        seen: list[torch.Tensor] = []

        def record(param: torch.Tensor, fill: object, seen: list[torch.Tensor] = seen) -> None:
            seen.append(param)
            param.fill_(0.5)  # ignore `fill` on purpose: proves nothing bypasses param_init

        model.init_weights(param_init=record)
        assert [id(p) for p in seen] == [id(p) for p in model.parameters()]
        assert len({id(p) for p in seen}) == len(seen)
        assert all(p.eq(0.5).all() for p in model.parameters())


def test_init_is_deterministic_under_seed() -> None:
    a, b, c = _build(_debug_args(), seed=3), _build(_debug_args(), seed=3), _build(_debug_args(), seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_init_weights_recomputes_freqs_cis_on_buffer_device() -> None:
    args = _debug_args()
    with torch.device("meta"):
        model = Transformer(args)
    assert model.freqs_cis.is_meta
    model.to_empty(device="cpu")
    model.freqs_cis.fill_(float("nan"))
    model.init_weights(buffer_device=torch.device("cpu"))
    expected = precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
    assert torch.equal(model.freqs_cis, expected)


def test_tied_embeddings_share_and_count_once() -> None:
    untied_args, tied_args = _debug_args(), _debug_args(tie_word_embeddings=True)
    tied = _build(tied_args)
    assert tied.output.weight is tied.tok_embeddings.weight
    # Tied matrix doubles as the output projection, so it gets the output init, not std 1.0.
    assert tied.tok_embeddings.weight.std().item() == pytest.approx(256**-0.5, rel=0.05)
    with torch.device("meta"):
        untied = Transformer(untied_args)
    n_tied, flops_tied = get_nparams_and_flops(tied, tied_args, 64)
    n_untied, flops_untied = get_nparams_and_flops(untied, untied_args, 64)
    assert n_untied - n_tied == 8192 * 256
    assert flops_tied == flops_untied  # the output matmul happens either way
    loss = tied(_tokens()).float().logsumexp(-1).mean()
    loss.backward()
    assert tied.tok_embeddings.weight.grad is not None


# ----------------------------------------------------------------------------- forward semantics


def test_causality(debug_model: Transformer) -> None:
    tokens = _tokens(batch=1, seq=24)
    changed = tokens.clone()
    t = 11
    changed[0, t] = (changed[0, t] + 1) % 8192
    with torch.no_grad():
        a, b = debug_model(tokens), debug_model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_gqa_matches_mha_with_repeated_kv_weights() -> None:
    torch.manual_seed(0)
    gqa_args = _debug_args()
    mha_args = _debug_args(n_kv_heads=None)
    gqa, mha = Attention(gqa_args), Attention(mha_args)
    n_rep, hd = gqa_args.n_heads // gqa_args.num_kv_heads, gqa_args.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for src, dst in ((gqa.wk, mha.wk), (gqa.wv, mha.wv)):
            # query head h reads kv head h // n_rep
            per_head = src.weight.view(gqa_args.num_kv_heads, hd, -1)
            dst.weight.copy_(per_head.repeat_interleave(n_rep, dim=0).reshape(-1, per_head.shape[-1]))
    x = torch.randn(2, 10, gqa_args.dim)
    freqs = precompute_freqs_cis(hd, 10, gqa_args.rope_theta, gqa_args.rope_scaling)
    torch.testing.assert_close(gqa(x, freqs), mha(x, freqs))


def test_pipeline_cut_model_runs_on_hidden_states(debug_model: Transformer) -> None:
    tokens = _tokens()
    first, last = copy.deepcopy(debug_model), copy.deepcopy(debug_model)
    first.norm = None
    first.output = None
    del first.layers["2"], first.layers["3"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, 256)
        torch.testing.assert_close(last(hidden), debug_model(tokens))
        middle = copy.deepcopy(last)
        middle.norm = None
        middle.output = None
        assert middle(hidden).shape == (2, 16, 256)
    # A stage's re-initialisation must use the layers' own depth, not their position in the stage.
    last.init_weights()
    assert last.layers["3"].weight_init_std == debug_model.layers["3"].weight_init_std


def test_sequence_longer_than_table_is_rejected(debug_model: Transformer) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        debug_model(_tokens(batch=1, seq=65))


def test_rmsnorm_bf16_computes_in_fp32(debug_model: Transformer) -> None:
    norm = debug_model.norm
    x = torch.randn(3, 256) * 100
    out = norm(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    ref = x.to(torch.bfloat16).float()
    ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_fp32_formula_for_every_dtype_pair(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    # FSDP bf16 gives bf16 x and weight (fused kernel), autocast bf16 x with an fp32 weight (fp32 path).
    norm = RMSNorm(64, eps=1e-5).to(weight_dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 9, 64) * 30).to(x_dtype)
    out = norm(x)
    assert out.dtype == x_dtype
    x32 = x.float()
    ref = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    tol = {"rtol": 0, "atol": 0} if x_dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(out, ref.to(x_dtype), **tol)


# ----------------------------------------------------------------------------- RoPE


def test_rope_scaling_only_slows_low_frequencies() -> None:
    scaling = RoPEScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    plain = rope_frequencies(128, 500000.0)
    scaled = rope_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    middle = ~(high | low)
    assert high[0] and low[-1] and middle.any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    ratio = scaled[middle] / plain[middle]
    assert (ratio > 1 / 8.0).all() and (ratio < 1.0).all()
    assert (ratio[1:] <= ratio[:-1]).all()  # smoothly more scaling as wavelength grows

    table_plain = precompute_freqs_cis(128, 32, 500000.0)
    table_scaled = precompute_freqs_cis(128, 32, 500000.0, scaling)
    assert torch.equal(table_scaled[:, 0], table_plain[:, 0])
    assert not torch.allclose(table_scaled[1:, -1], table_plain[1:, -1])
    torch.testing.assert_close(table_plain[0], torch.tensor([1.0, 0.0]).expand(64, 2))


def test_rope_uses_interleaved_pair_layout() -> None:
    hd, seq = 16, 7
    freqs_cis = precompute_freqs_cis(hd, seq, 10000.0)
    x = torch.randn(2, seq, 3, hd)
    # Reference: channels (2i, 2i+1) are one complex number multiplied by e^{i * pos * freq_i}.
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), rope_frequencies(hd, 10000.0))
    rot = torch.polar(torch.ones_like(angles), angles).view(1, seq, 1, hd // 2)
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)
    torch.testing.assert_close(apply_rotary_emb(x, freqs_cis), expected)


def test_rope_attention_scores_depend_on_relative_position() -> None:
    hd = 32
    freqs_cis = precompute_freqs_cis(hd, 40, 500000.0, RoPEScaling())
    q, k = torch.randn(hd), torch.randn(hd)

    def score(pq: int, pk: int) -> torch.Tensor:
        seq = max(pq, pk) + 1
        qs = q.expand(1, seq, 1, hd)
        ks = k.expand(1, seq, 1, hd)
        return (apply_rotary_emb(qs, freqs_cis)[0, pq, 0] * apply_rotary_emb(ks, freqs_cis)[0, pk, 0]).sum()

    torch.testing.assert_close(score(5, 2), score(30, 27), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- training and FLOPs


def test_sgd_steps_decrease_loss() -> None:
    model = _build(_debug_args(n_layers=2))
    tokens = torch.arange(8).repeat(1, 4)  # tiny repeated sequence: trivially learnable
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_flops_sanity() -> None:
    args = llama3_flavors["debugmodel"]
    with torch.device("meta"):
        model = Transformer(args)
    nparams, f1 = get_nparams_and_flops(model, args, 1024)
    _, f2 = get_nparams_and_flops(model, args, 2048)
    _, f3 = get_nparams_and_flops(model, args, 3072)
    non_embedding = nparams - args.vocab_size * args.dim
    assert f1 > 6 * non_embedding
    assert f2 - f1 == f3 - f2 == 12 * args.n_layers * args.n_heads * args.head_dim * 1024
    assert f1 == 6 * non_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * 1024
