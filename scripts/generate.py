"""Generate text from a checkpoint: a Hugging Face folder or a DCP step folder written by a run.

    python scripts/generate.py <hf folder> --prompt "def fibonacci(n):" [--prompt ...] [--prompts-file FILE]
    python scripts/generate.py <dcp step folder> --flavor debugmodel [--model llama3] [--tokenizer PATH] ...
    options: --max-new-tokens 64  --temperature 0 (greedy) | 0.8 [--top-k 50] [--top-p 0.95] [--seed 0]
             --stop-token ID (repeatable; the tokenizer's EOS stops too unless --ignore-eos)
             --ids (prompts and output as token ids: no tokenizer)  --logprobs  --json  --batch-size 8
             --chat [auto|tokenizer|llama3|chatml|deepseek_v3|FILE.jinja] (prompts as user messages)
             --device cuda|cpu  --dtype float32|bfloat16

The folder's kind is told by its files: config.json (Hugging Face, written by `checkpoint.last_save_in_hf` or
scripts/convert_checkpoint.py; the model is the one whose adapter reads config.json, its tokenizer the folder's own)
or .metadata (DCP: a DCP folder does not record its model, so `--model` and `--flavor` name it as in the run's config,
`--seq-len` its training.seq_len when the run changed max_seq_len; its tokenizer is `--tokenizer`, as
model.tokenizer_path, by default the default BPE sized to the model). Prompts come from `--prompt` (repeatable) and
`--prompts-file` (one prompt per line; in a .jsonl file, one JSON string, {"prompt": ...} object or conversation
{"messages": [...]} per line). Each is encoded with BOS first (unless --no-bos), or with `--chat [TEMPLATE]` (and
always for a conversation) rendered by the chat template up to the assistant's header (docs/finetuning.md), and
continued by torchtitan/generation (KV cache, greedy or sampled; see docs/generation.md). Runs on one device, the
whole model on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Runnable as a plain script from a checkout: make the package importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

import torch  # noqa: E402

from torchtitan.data.chat import render_generation_prompt, stop_token_ids  # noqa: E402
from torchtitan.generation import GenerationConfig, generate  # noqa: E402
from torchtitan.tools import startup_gc  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class GenerateError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# The model and its tokenizer
# ---------------------------------------------------------------------------------------------


def _read_checkpoint(ns: argparse.Namespace) -> tuple[object, object, dict[str, torch.Tensor]]:
    """(model spec, model args, our state dict) of the checkpoint folder."""
    from torchtitan.components import hf_io
    from torchtitan.models.registry import get_model_spec

    path = Path(ns.checkpoint)
    if (path / hf_io.CONFIG_NAME).is_file():
        adapter, args = hf_io.resolve_folder(path, None, ns.model)
        state, args = hf_io.load_hf(path, args, model=adapter)
        return get_model_spec(hf_io.model_name_of(adapter)), args, state
    from torchtitan.components import checkpoint_io as cio

    if not (path / cio.METADATA).is_file():
        raise GenerateError(f"{path}: neither a Hugging Face folder (config.json) nor a DCP checkpoint (.metadata)")
    if ns.flavor is None:
        raise GenerateError(f"{path}: a DCP checkpoint does not record its model: pass --flavor (and --model)")
    spec = get_model_spec(ns.model or "llama3")
    if ns.flavor not in spec.flavors:
        known = ", ".join(sorted(spec.flavors))
        raise GenerateError(f"--flavor: unknown '{ns.flavor}' for {spec.name}; known: {known}")
    args = spec.flavors[ns.flavor]
    if ns.seq_len is not None:
        import dataclasses

        args = dataclasses.replace(args, max_seq_len=ns.seq_len)  # as the trainer's model_args_for does
    try:
        state = cio.load_full_model_state(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise GenerateError(f"{path}: cannot read the checkpoint: {' '.join(str(e).split())[:300]}") from e
    return spec, args, state


def load_model(ns: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's model on `device` in `dtype`, in eval mode: built on meta, materialised empty, then filled
    by the checkpoint alone (no random init of weights that are overwritten at once)."""
    spec, args, state = _read_checkpoint(ns)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    model.to(dtype)
    for module in model.modules():  # the MoE routing bias stays fp32, as in training (torchtitan/models/moe/moe.py)
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias = module.expert_bias.float()
    # Rebuilds the rotary table (fp32) and the MoE buffers; the parameters are left to the checkpoint.
    model.init_weights(buffer_device=device, param_init=lambda param, fill: None)
    if args.tie_word_embeddings and "output.weight" not in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise GenerateError(f"{ns.checkpoint}: does not fit {spec.name} ({' '.join(str(e).split())[:300]})") from e
    return model.eval()


def load_tokenizer(ns: argparse.Namespace, vocab_size: int):
    """The tokenizer: --tokenizer, else a Hugging Face folder's own, else (DCP) the default BPE sized to the model."""
    from torchtitan.data.tokenizer import build_tokenizer, default_cache_dir

    path = ns.tokenizer
    folder = Path(ns.checkpoint)
    if path is None:
        if (folder / "config.json").is_file():
            if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
                raise GenerateError(f"{folder}: holds no tokenizer: pass --tokenizer (or --ids)")
            path = str(folder)
        else:
            path = ""
    try:
        tokenizer = build_tokenizer(path, default_cache_dir(), vocab_size)
    except (OSError, ValueError) as e:
        raise GenerateError(f"--tokenizer: {str(e).removeprefix('model.tokenizer_path: ')}") from None
    if tokenizer.vocab_size > vocab_size:
        raise GenerateError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary {vocab_size}")
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def read_prompts(ns: argparse.Namespace) -> list[str | list[dict]]:
    """Text prompts, and conversations ({"messages": [...]} lines of a .jsonl file), in order."""
    prompts = list(ns.prompt or [])
    if ns.prompts_file:
        path = Path(ns.prompts_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise GenerateError(f"--prompts-file: {e}") from None
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                prompts.append(line)
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise GenerateError(f"{path}:{i}: invalid JSON ({e})") from None
            if isinstance(item, dict) and "messages" in item:  # rendered with the chat template (encode_prompt)
                if ns.ids:
                    raise GenerateError(f"{path}:{i}: chat messages need a tokenizer (not --ids)")
                prompts.append(item["messages"])
                continue
            text = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise GenerateError(f"{path}:{i}: expected a JSON string or an object with a \"prompt\" string")
            prompts.append(text)
    if not prompts:
        raise GenerateError("no prompts: give --prompt TEXT or --prompts-file FILE")
    return prompts


def encode_prompt(text: str | list[dict], tokenizer, ns: argparse.Namespace) -> list[int]:
    """Token ids of one prompt. A conversation, or any prompt with --chat (as one user message), is rendered by the
    chat template up to the assistant's turn header (torchtitan/data/chat.py)."""
    if isinstance(text, list) or ns.chat:
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        try:
            return render_generation_prompt(tokenizer, messages, ns.chat or "auto")
        except ValueError as e:
            raise GenerateError(str(e)) from None
    if ns.ids:
        try:
            ids = [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise GenerateError(f"--ids: prompt {text!r} is not a list of token ids") from None
        if not ids:
            raise GenerateError("--ids: an empty prompt")
        return ids
    ids = tokenizer.encode(text, add_bos=not ns.no_bos, add_eos=False)
    if not ids:
        raise GenerateError(f"prompt {text!r} encodes to no tokens (and --no-bos is set)")
    return ids


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def run(ns: argparse.Namespace) -> list[dict]:
    """One record per prompt: prompt, token ids, completion text (without its stop token), finish reason, and the
    new tokens' log-probabilities with --logprobs."""
    device = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[ns.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if ns.batch_size < 1:
        raise GenerateError(f"--batch-size must be positive, got {ns.batch_size}")
    prompts = read_prompts(ns)
    model = load_model(ns, device, dtype)
    vocab = model.model_args.vocab_size
    tokenizer = None if ns.ids else load_tokenizer(ns, vocab)
    stop = list(ns.stop_token or [])
    if tokenizer is not None and not ns.ignore_eos:
        chat = ns.chat or ("auto" if any(isinstance(p, list) for p in prompts) else None)
        # a chat reply ends at the template's end-of-turn token (then EOS)
        stop.extend(stop_token_ids(tokenizer, chat) if chat else [tokenizer.eos_id])
    config = GenerationConfig(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_k=ns.top_k,
                              top_p=ns.top_p, stop_tokens=tuple(stop), seed=ns.seed, return_logprobs=ns.logprobs)
    encoded = [encode_prompt(p, tokenizer, ns) for p in prompts]
    records = []
    for first in range(0, len(encoded), ns.batch_size):
        batch = encoded[first:first + ns.batch_size]
        try:
            result = generate(model, batch, config)
        except ValueError as e:
            raise GenerateError(str(e)) from None
        for i, new in enumerate(result.sequences()):
            reason = result.finish_reasons[i]
            record = {"prompt": prompts[first + i], "prompt_tokens": batch[i], "tokens": new, "finish_reason": reason}
            if tokenizer is not None:
                text_ids = new[:-1] if reason == "stop" else new
                record["completion"] = tokenizer.decode(text_ids)
            if result.logprobs is not None:
                record["logprobs"] = result.logprobs[i, :len(new)].tolist()
            records.append(record)
    return records


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="Hugging Face folder (config.json) or DCP step folder (.metadata)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="one prompt per line; .jsonl: a JSON string, {\"prompt\": ...} or a "
                   "conversation {\"messages\": [...]} (chat template) per line")
    p.add_argument("--ids", action="store_true", help="prompts are token ids (space or comma separated); no tokenizer")
    p.add_argument("--no-bos", action="store_true", help="do not put the tokenizer's BOS before each prompt")
    p.add_argument("--chat", nargs="?", const="auto", default=None, metavar="TEMPLATE",
                   help="render each prompt as a user message with the chat template (auto | tokenizer | llama3 | "
                   "chatml | deepseek_v3 | a .jinja file; as training.chat_template) and stop at its end of turn")
    p.add_argument("--model", default=None, help="registered model name (DCP: default llama3; Hugging Face: the one "
                   "whose adapter reads config.json)")
    p.add_argument("--flavor", default=None, help="the run's model.flavor (DCP folders)")
    p.add_argument("--seq-len", type=int, default=None, help="the run's max_seq_len if it changed it (DCP folders)")
    p.add_argument("--tokenizer", default=None, help="as model.tokenizer_path (default: a Hugging Face folder's own; "
                   "for DCP the default BPE sized to the model)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within the top-p nucleus (1: off)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    p.add_argument("--stop-token", type=int, action="append", help="a token id that ends a row (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="the tokenizer's EOS does not stop a row")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate() call")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="default: bfloat16 on cuda, else float32")
    p.add_argument("--logprobs", action="store_true", help="also report each new token's log-probability")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        records = run(ns)
    except (GenerateError, ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    for r in records:
        if ns.json:
            print(json.dumps(r))
            continue
        shown = r["completion"] if "completion" in r else " ".join(map(str, r["tokens"]))
        print(f"--- {r['prompt']!r} ({len(r['tokens'])} tokens, {r['finish_reason']})")
        print(shown)
        if "logprobs" in r:
            print("logprobs: " + " ".join(f"{x:.3f}" for x in r["logprobs"]))
    return 0


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    sys.exit(main())
