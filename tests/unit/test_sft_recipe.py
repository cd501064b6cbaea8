"""The chat SFT recipe end to end (train_configs/llama3_sft_chat.toml, docs/finetuning.md), on a tiny Llama 3, a
tiny Qwen3 and a tiny DeepSeek-V3 (latent attention, a dense block then MoE blocks with a routing bias; the recipe's
model name overridden) exported to a Hugging Face folder with a chat tokenizer: the run starts from the folder's
weights (its first loss is the one `transformers` computes for the same batch and assistant-only labels), validates
on held-out conversations, and exports a Hugging Face folder that `transformers` loads and scripts/generate.py chats
with. CPU only, no network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.unit.forked import run_main
from tests.unit.test_chat_data import conversations, make_tokenizer, write_jsonl

REPO = Path(__file__).resolve().parents[2]
STEPS, BATCH, SEQ = 3, 2, 64


def _train(argv: list[str]) -> None:
    from torchtitan.train import main

    main(argv)


def _first_batch(tok, path: Path, template: str) -> dict[str, torch.Tensor]:
    from torchtitan.data.chat import ChatEncoder
    from torchtitan.data.chat_loader import build_chat_dataloader
    from torchtitan.data.chat_source import build_chat_source

    source = build_chat_source(dataset_path=str(path), dataset_format="chat", split="train", streaming="false",
                               cache_dir=None, key_prefix="training")
    loader = build_chat_dataloader(source=source, encoder=ChatEncoder(tok, template, "assistant"), seq_len=SEQ,
                                   local_batch_size=BATCH, dp_rank=0, dp_degree=1)
    return next(iter(loader))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(("model", "template"), [("llama3", "llama3"), ("qwen3", "chatml"),
                                                  ("deepseek_v3", "deepseek_v3")])
def test_chat_sft_from_a_hugging_face_folder_and_back(model: str, template: str, tmp_path: Path, capsys) -> None:
    import transformers

    from torchtitan.components.hf_io import save_hf
    from torchtitan.models.registry import get_model_spec

    tok = make_tokenizer(tmp_path / "tok")  # bytes plus the chat special tokens (267 ids)
    torch.manual_seed(0)
    spec = get_model_spec(model)
    base = spec.model_cls(spec.flavors["debugmodel_small"])  # vocabulary 512
    base.init_weights()
    if model == "deepseek_v3":
        # At the initial scale the routed experts and the latent attention hardly move the loss (their gate and up
        # projections swapped in the import changed it by 7e-6 relative): sharpened, and with a routing bias that
        # decides something, the same swap moves the first loss by 2e-3.
        from tests.unit.test_deepseek_v3_hf import _perturb

        _perturb([*base.named_parameters(), *base.named_buffers()], seed=1)
    hf_in = save_hf(tmp_path / "base-hf", base.state_dict(), base.model_args, model=model, tokenizer=tok)
    train, val = write_jsonl(tmp_path / "train.jsonl", conversations(12, seed=5)), \
        write_jsonl(tmp_path / "val.jsonl", conversations(4, seed=6))
    argv = ["--job.config_file", str(REPO / "train_configs" / "llama3_sft_chat.toml"),
            "--job.dump_folder", str(tmp_path / "run"), "--model.flavor", "debugmodel_small",
            "--model.tokenizer_path", str(hf_in), "--checkpoint.initial_load_path", str(hf_in),
            "--training.dataset_path", str(train), "--validation.dataset_path", str(val),
            "--training.chat_template", template, "--model.name", model, "--training.seq_len", str(SEQ),
            "--training.local_batch_size", str(BATCH), "--training.steps", str(STEPS), "--training.num_workers", "0",
            "--validation.freq", str(STEPS), "--checkpoint.interval", str(STEPS), "--metrics.log_freq", "1",
            "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "1", "--activation_checkpoint.mode", "none"]
    code, _, err = run_main(_train, argv, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                               "TORCHTITAN_CACHE_DIR": str(tmp_path / "cache")}, cwd=REPO)
    assert code == 0, err[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    # Step 1 trains the imported weights: its loss is transformers' cross-entropy of the same batch over the
    # assistant tokens only (a run that started from random weights, or labelled prompts, would differ).
    batch = _first_batch(tok, train, template)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_in, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = reference(batch["tokens"]).logits
    labels = batch["labels"]
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert metrics[0]["step"] == 1 and metrics[0]["loss"] == pytest.approx(want.item(), rel=1e-4)
    assert (labels != -100).sum() < labels.numel() / 2  # prompts and padding carry no labels
    (val_record,) = [m for m in metrics if "val_loss" in m]
    assert 0 < val_record["val_tokens"] and val_record["val_loss"] < metrics[0]["loss"] + 1

    # The final export is a self-contained Hugging Face folder holding the trained (moved) weights.
    hf_out = tmp_path / "run" / "checkpoint" / f"step-{STEPS}-hf"
    tuned = transformers.AutoModelForCausalLM.from_pretrained(hf_out, torch_dtype=torch.float32)
    moved = [name for name, p in tuned.state_dict().items()
             if not torch.equal(p, reference.state_dict()[name])]
    assert len(moved) == len(reference.state_dict())  # every weight trained (full fine-tuning)
    # Its tokenizer carries the template the run rendered with: transformers' apply_chat_template and our renderer
    # give the same prompt ids, and scripts/generate.py chats with the folder's own template.
    from tests.scripts import load_script
    from torchtitan.data.chat import render_generation_prompt

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    want_ids = render_generation_prompt(tok, messages, template)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_out)
    got = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(got["input_ids"] if hasattr(got, "keys") else got) == want_ids
    assert load_script("generate").main([str(hf_out), "--prompt", "hi", "--chat", "tokenizer", "--max-new-tokens", "3",
                                         "--json", "--device", "cpu"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert record["prompt_tokens"] == render_generation_prompt(tok, [{"role": "user", "content": "hi"}], template)
