"""Generation with a KV cache (torchtitan/generation): the cache against full recomputation for every model family,
batches of different prompt lengths, sampling against hand-computed distributions, stop tokens, max_new_tokens,
log-probabilities, the compressed MLA cache, and scripts/generate.py end to end on tiny offline checkpoints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torchtitan.generation import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationConfig,
    KVCache,
    choose_tokens,
    generate,
    sample,
    sampling_logits,
    top_k_filter,
    top_p_filter,
)
from torchtitan.models.deepseek_v3.args import YaRNScaling
from torchtitan.models.registry import get_model_spec

# Tiny models (dim 64, 2 blocks) that keep each family's particulars: GQA, Qwen3's QK-norm and MoE blocks, MLA's odd
# widths with a dense block then an MoE block, with and without the low-rank query, and YaRN (q_scale != 1).
FAMILIES = {
    "llama3": ("llama3", "debugmodel_small", {}),
    "qwen3": ("qwen3", "debugmodel_small", {}),
    "qwen3_moe": ("qwen3", "debugmodel_moe_small", {}),
    "deepseek_v3": ("deepseek_v3", "debugmodel_small", {}),
    "deepseek_v3_qlora_yarn": ("deepseek_v3", "debugmodel_small_qlora",
                               {"rope_scaling": YaRNScaling(factor=4.0, original_max_position_embeddings=16,
                                                            mscale=1.0, mscale_all_dim=1.0)}),
}
PROMPTS = [[5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 301], [400, 2, 77], [123, 45, 6, 7, 300, 1]]
NEW = 8
RTOL = 1e-5
_MODELS: dict[str, torch.nn.Module] = {}


def _build(family: str, n_layers: int | None = 2) -> torch.nn.Module:
    """A tiny model whose greedy continuations vary (at the default init they repeat one token, which would hide a
    wrong position or a dropped past): random norm weights, routers with decisive logits, an output projection that
    is a permutation of the embedding rows, and attention projections large enough that the past matters.
    n_layers None: the flavor's own depth."""
    key = f"{family}/{n_layers}"
    if key in _MODELS:
        return _MODELS[key]
    name, flavor, extra = FAMILIES[family]
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=64, **extra)
    if n_layers is not None:
        args = dataclasses.replace(args, n_layers=n_layers)
    _MODELS[key] = sharpened(spec, args).eval()
    return _MODELS[key]


def sharpened(spec, args) -> torch.nn.Module:
    """The model of `args`, seeded, with random norm weights, decisive routers, attention projections x4 and (untied)
    an output projection that permutes the embedding rows: greedy continuations then vary. Also used by
    tests/unit/test_rl_tp_generator.py, whose ranks must each build the same model."""
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "router" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif ".attention." in pname:
                p.mul_(4.0)
        if not args.tie_word_embeddings:
            perm = torch.randperm(args.vocab_size, generator=gen)
            model.output.weight.copy_(model.tok_embeddings.weight[perm] * 0.5)
    return model


def _full_recompute(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding without a cache: the whole sequence through the model at every step; (tokens, logits)."""
    seq = torch.tensor([prompt])
    logits = []
    with torch.no_grad():
        for _ in range(n):
            step = model(seq)[0, -1].float()
            logits.append(step)
            seq = torch.cat([seq, step.argmax().view(1, 1)], dim=1)
    return seq[0, len(prompt):].tolist(), torch.stack(logits)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------
# The cache against full recomputation, per family
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_greedy_equals_full_recompute(family: str) -> None:
    model = _build(family)
    prompt = PROMPTS[0]
    result = generate(model, [prompt], GenerationConfig(max_new_tokens=NEW, return_logits=True, return_logprobs=True))
    want_tokens, want_logits = _full_recompute(model, prompt, NEW)
    assert result.sequences() == [want_tokens]
    assert len(set(want_tokens)) > 2, want_tokens  # the continuation varies: the comparison means something
    assert _rel(result.logits[0], want_logits) <= RTOL
    assert torch.allclose(result.logprobs[0], want_logits.log_softmax(-1).gather(-1, torch.tensor(want_tokens)[:, None])
                          .squeeze(-1), rtol=RTOL, atol=1e-5)
    assert result.finish_reasons == [FINISH_LENGTH] and result.lengths.tolist() == [NEW]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_of_different_lengths_equals_each_prompt_alone(family: str) -> None:
    model = _build(family)
    config = GenerationConfig(max_new_tokens=NEW, return_logits=True)
    batch = generate(model, PROMPTS, config)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], config)
        assert batch.sequences()[i] == alone.sequences()[0], i
        assert _rel(batch.logits[i], alone.logits[0]) <= RTOL, i


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampled_logprobs_are_the_full_recompute_log_softmax(family: str) -> None:
    model = _build(family)
    config = GenerationConfig(max_new_tokens=NEW, temperature=1.5, top_k=20, top_p=0.9, seed=3, return_logprobs=True)
    result = generate(model, PROMPTS, config)
    for i, (prompt, new) in enumerate(zip(PROMPTS, result.sequences(), strict=True)):
        with torch.no_grad():  # one forward over prompt + sample: position t's logits predict token t + 1
            logits = model(torch.tensor([prompt + new]))[0, len(prompt) - 1:-1].float()
        want = logits.log_softmax(-1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1)
        assert torch.allclose(result.logprobs[i, :len(new)], want, rtol=RTOL, atol=1e-5), i
    again = generate(model, PROMPTS, config)  # the seed makes it reproducible
    assert torch.equal(again.tokens, result.tokens)


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_prompt_fed_in_chunks_equals_one_forward(family: str) -> None:
    """The lower-level API: a left-padded batch fed to the cache in chunks of several tokens (the masked,
    non-prompt path; MLA's latent attention for more than one query) gives each row's own logits."""
    model = _build(family)
    rows = [PROMPTS[0][:9], PROMPTS[2]]  # 9 and 6 tokens: row 1 has 3 slots of padding
    tokens = torch.tensor([rows[0], [0, 0, 0] + rows[1]])
    cache = KVCache(torch.tensor([0, 3]), max_len=9)
    with torch.no_grad():
        for chunk in (tokens[:, :4], tokens[:, 4:8], tokens[:, 8:]):
            last = model(chunk, cache=cache)[:, -1]
        for i, row in enumerate(rows):
            assert _rel(last[i], model(torch.tensor([row]))[0, -1]) <= RTOL, i


def test_deepseek_v3_cache_holds_the_compressed_latent() -> None:
    model = _build("deepseek_v3")
    a = model.model_args
    cache = KVCache(torch.tensor([0, 2]), max_len=10)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4], [0, 0, 5, 6]]), cache=cache)
        model(torch.tensor([[7], [8]]), cache=cache)
    assert cache.length == 5 and set(cache.layers) == {"0", "1"}
    for layer in cache.layers.values():
        (buf,) = layer.buffers
        assert tuple(buf.shape) == (2, 10, a.kv_lora_rank + a.qk_rope_head_dim)
        assert layer.elements_per_token() == a.kv_lora_rank + a.qk_rope_head_dim
        assert layer.elements_per_token() < a.n_heads * (a.qk_head_dim + a.v_head_dim)  # not expanded K/V
    assert cache.elements_per_token() == a.n_layers * (a.kv_lora_rank + a.qk_rope_head_dim)
    llama = _build("llama3")
    cache = KVCache(torch.tensor([0]), max_len=4)
    with torch.no_grad():
        llama(torch.tensor([[1, 2]]), cache=cache)
    la = llama.model_args
    assert cache.layers["0"].elements_per_token() == 2 * la.num_kv_heads * la.head_dim


# ---------------------------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------------------------


def test_stop_token_ends_a_row_while_the_others_continue() -> None:
    model = _build("llama3")
    free = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW)).sequences()
    # A token that row 1 produces at step 2 and that rows 0 and 2 never produce.
    stop_tok = free[1][2]
    assert stop_tok not in free[0] + free[2] and stop_tok not in free[1][:2], free
    result = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW, stop_tokens=(stop_tok,), pad_id=1,
                                                       return_logprobs=True))
    assert result.sequences() == [free[0], free[1][:3], free[2]]
    assert result.lengths.tolist() == [NEW, 3, NEW]
    assert result.finish_reasons == [FINISH_LENGTH, FINISH_STOP, FINISH_LENGTH]
    assert result.tokens[1, 3:].tolist() == [1] * (NEW - 3) and (result.logprobs[1, 3:] == 0).all()
    # Every row stopped: generation ends early.
    early = generate(model, [PROMPTS[1]], GenerationConfig(max_new_tokens=NEW, stop_tokens=(stop_tok,)))
    assert early.tokens.shape == (1, 3) and early.finish_reasons == [FINISH_STOP]


def test_max_new_tokens_and_max_seq_len() -> None:
    model = _build("qwen3")
    for n in (1, 3):
        result = generate(model, PROMPTS, GenerationConfig(max_new_tokens=n))
        assert result.tokens.shape == (3, n) and result.lengths.tolist() == [n] * 3
        assert result.finish_reasons == [FINISH_LENGTH] * 3
    longest = max(len(p) for p in PROMPTS)
    generate(model, PROMPTS, GenerationConfig(max_new_tokens=64 - longest + 1))  # the last fed position is 63
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, PROMPTS, GenerationConfig(max_new_tokens=64 - longest + 2))
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1], []])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, PROMPTS, GenerationConfig(max_new_tokens=0))


# ---------------------------------------------------------------------------------------------
# Sampling against hand-computed distributions
# ---------------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.0, -1.0, 5.0, 2.0]])
    inf = float("-inf")
    assert torch.equal(top_k_filter(logits, 2), torch.tensor([[inf, 4.0, inf, 3.0], [inf, inf, 5.0, 2.0]]))
    assert torch.equal(top_k_filter(logits, 0), logits) and torch.equal(top_k_filter(logits, 4), logits)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]  # 0.5 alone reaches 0.5
    assert kept(0.6) == [False, True, False, True]  # 0.5 + 0.25
    assert kept(0.75) == [False, True, False, True]  # exactly reached: 0.75
    assert kept(0.8) == [False, True, True, True]  # 0.9
    assert kept(0.95) == [True, True, True, True]
    assert kept(0.01) == [False, True, False, False]  # the most probable token always stays
    # The renormalised distribution after top-p 0.6: 0.5 / 0.75 and 0.25 / 0.75.
    got = sampling_logits(logits, 1.0, top_p=0.6).softmax(-1)
    assert torch.allclose(got, torch.tensor([[0.0, 2 / 3, 0.0, 1 / 3]]))


def test_temperature_and_greedy() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    assert choose_tokens(logits, 0.0, top_k=2, top_p=0.1).tolist() == [1, 0]  # temperature 0: the argmax
    got = sampling_logits(logits, 2.0).softmax(-1)
    want = torch.exp(logits / 2) / torch.exp(logits / 2).sum(-1, keepdim=True)
    assert torch.allclose(got, want)
    combined = sampling_logits(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 0.5, top_k=3, top_p=0.8).softmax(-1)
    # / 0.5 -> [0, 2, 4, 6]; top-3 drops index 0; softmax over [2, 4, 6] = [0.016, 0.117, 0.867]: 0.867 >= 0.8
    assert torch.equal(combined[0] > 0, torch.tensor([False, False, False, True]))
    with pytest.raises(ValueError):
        sampling_logits(logits, 0.0)


def test_sample_draws_with_the_given_probabilities() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    gen = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(20000, 4).contiguous(), gen)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0  # never a zero-probability token
    assert torch.allclose(freq, probs, atol=0.015), freq  # 4+ standard errors at n = 20000
    again = sample(probs.expand(20000, 4).contiguous(), torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)


# ---------------------------------------------------------------------------------------------
# scripts/generate.py end to end
# ---------------------------------------------------------------------------------------------


def _script():
    from tests.scripts import load_script

    return load_script("generate")


def test_script_generates_from_a_hugging_face_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    from torchtitan.components.hf_io import save_hf
    from torchtitan.data import tokenizer as tok_mod

    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tok_mod, "_TRAIN_BYTES", 100_000)  # the default BPE on a small sample: a fraction of a second
    model = _build("llama3")  # vocabulary 512, as the default BPE sized to it
    tok = tok_mod.build_tokenizer("", tmp_path / "cache", model.model_args.vocab_size)
    folder = save_hf(tmp_path / "hf", model.state_dict(), model.model_args, model="llama3", tokenizer=tok)
    texts = ["import os\nclass Foo(object):", "def f(x):"]
    argv = [str(folder), "--prompt", texts[0], "--prompt", texts[1], "--max-new-tokens", "6", "--json",
            "--logprobs", "--device", "cpu"]
    assert _script().main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    prompts = [tok.encode(t, add_bos=True, add_eos=False) for t in texts]
    want = generate(model, prompts, GenerationConfig(max_new_tokens=6, stop_tokens=(tok.eos_id,),
                                                     return_logprobs=True))
    assert [r["prompt"] for r in records] == texts
    assert [r["prompt_tokens"] for r in records] == prompts
    assert [r["tokens"] for r in records] == want.sequences()
    for r, row in zip(records, want.logprobs, strict=True):
        assert r["finish_reason"] in (FINISH_STOP, FINISH_LENGTH)
        assert r["completion"] == tok.decode(r["tokens"][:-1] if r["finish_reason"] == FINISH_STOP else r["tokens"])
        assert r["logprobs"] == pytest.approx(row[:len(r["tokens"])].tolist(), rel=1e-5, abs=1e-6)
    # Sampling is reproducible from the command line; errors are one line and exit code 2.
    sampled = [str(folder), "--prompt", texts[1], "--max-new-tokens", "4", "--temperature", "1", "--top-p", "0.9",
               "--seed", "7", "--json"]
    assert _script().main(sampled) == 0 and _script().main(sampled) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second
    assert _script().main([str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a Hugging Face folder" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_script_generates_from_a_dcp_checkpoint_with_token_ids(tmp_path: Path, capsys) -> None:
    import torch.distributed.checkpoint as dcp

    model = _build("deepseek_v3", n_layers=None)  # the registry's flavor exactly: the script builds it by name
    step = tmp_path / "step-5"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    argv = [str(step), "--model", "deepseek_v3", "--flavor", "debugmodel_small", "--seq-len", "64", "--ids",
            "--prompt", " ".join(map(str, PROMPTS[0])), "--prompt", "400, 2, 77", "--max-new-tokens", "5", "--json"]
    assert _script().main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = generate(model, PROMPTS[:2], GenerationConfig(max_new_tokens=5)).sequences()
    assert [r["tokens"] for r in records] == want and all("completion" not in r for r in records)
    assert _script().main(argv[:1] + ["--ids", "--prompt", "1 2"]) == 2
    assert "--flavor" in capsys.readouterr().err


def test_script_reads_prompt_files(tmp_path: Path) -> None:
    script = _script()
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond: {\"not json\"}\n")
    (tmp_path / "p.jsonl").write_text('"a string"\n{"prompt": "an object"}\n')
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    read = lambda *extra: script.read_prompts(script.build_parser().parse_args(["x", *extra]))  # noqa: E731
    assert read("--prompt", "p0", "--prompts-file", str(tmp_path / "p.txt")) == [
        "p0", "first prompt", 'second: {"not json"}']
    assert read("--prompts-file", str(tmp_path / "p.jsonl")) == ["a string", "an object"]
    assert read("--prompts-file", str(tmp_path / "chat.jsonl")) == [[{"role": "user", "content": "hi"}]]
    with pytest.raises(script.GenerateError, match="need a tokenizer"):
        read("--ids", "--prompts-file", str(tmp_path / "chat.jsonl"))
    with pytest.raises(script.GenerateError, match="no prompts"):
        read()


def test_script_renders_conversations_with_the_chat_template(tmp_path: Path, capsys) -> None:
    from tests.unit.test_chat_data import make_tokenizer
    from torchtitan.components.hf_io import save_hf
    from torchtitan.data.chat import render_generation_prompt, stop_token_ids

    tok = make_tokenizer(tmp_path / "tok")  # bytes plus the chat special tokens of the three families
    model = _build("llama3")
    folder = save_hf(tmp_path / "hf", model.state_dict(), model.model_args, model="llama3", tokenizer=tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    argv = [str(folder), "--prompts-file", str(tmp_path / "chat.jsonl"), "--prompt", "Hello", "--chat", "chatml",
            "--max-new-tokens", "5", "--json", "--device", "cpu"]
    assert _script().main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # a text prompt as one user message, and a conversation, each up to the assistant's header
    prompts = [render_generation_prompt(tok, [{"role": "user", "content": "Hello"}], "chatml"),
               render_generation_prompt(tok, messages, "chatml")]
    assert [r["prompt_tokens"] for r in records] == prompts
    for ids in prompts:  # ... <|im_start|> then "assistant\n", one token per character
        assert tok.backend.id_to_token(ids[-11]) == "<|im_start|>" and tok.decode(ids[-10:]) == "assistant\n"
    stop = tuple(stop_token_ids(tok, "chatml"))  # <|im_end|>, then EOS
    assert stop[0] == tok.backend.token_to_id("<|im_end|>")
    want = generate(model, prompts, GenerationConfig(max_new_tokens=5, stop_tokens=stop)).sequences()
    assert [r["tokens"] for r in records] == want


@pytest.mark.parametrize("family", ["llama3", "qwen3", "deepseek_v3"])
def test_greedy_equals_transformers_generate(family: str, tmp_path: Path) -> None:
    """Our cached greedy decoding against transformers' own generate() on the same weights, exported to a Hugging
    Face folder: an independent implementation of the model, its cache and its decoding loop."""
    import transformers

    from torchtitan.components.hf_io import save_hf

    model = _build(family)
    folder = save_hf(tmp_path / "hf", model.state_dict(), model.model_args, model=FAMILIES[family][0])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW)).sequences()
    for prompt, got in zip(PROMPTS, ours, strict=True):  # one prompt at a time: no padding conventions involved
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == got, (family, prompt)
