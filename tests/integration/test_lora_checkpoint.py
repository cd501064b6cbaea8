"""LoRA checkpoints (docs/finetuning.md, LoRA): adapter-only saves resume exactly on top of the base weights, also in
another layout, and the last step's exports (merged Hugging Face folder, PEFT adapters) hold what the run trained."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.integration.conftest import train_layout
from tests.integration.layouts import BLOCKS, COMMON, LORA, dp
from tests.integration.parity import assert_continues_bitwise, compare, from_step
from torchtitan.components.quantization.lora import is_adapter

pytestmark = pytest.mark.slow

STEPS, SAVED = 4, 2


def _base_hf(folder) -> None:
    """A Hugging Face folder of the debug model, initialised from another seed than the runs' (11): a resume that
    skipped the base weights would start from the run's own initialisation and differ."""
    from torchtitan.components.hf_io import save_hf
    from torchtitan.components.model_parts import materialize, model_args_for
    from torchtitan.config.manager import load_config
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.registry import get_model_spec

    cfg, _ = load_config(list(COMMON), 1)
    args = model_args_for(cfg)
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).model_cls(args)
    materialize([model], torch.device("cpu"), 5, dist_utils.param_init)
    save_hf(folder, model.state_dict(), args, model=cfg.model.name)


def _safetensors(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _size(folder) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_adapter_only_checkpoint_resumes_exactly_and_exports_match(pools, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base = tmp_path / "base"
    _base_hf(base)
    args = (*dp(8, 1), *LORA, "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval",
            str(SAVED), "--checkpoint.keep_latest_k", "0", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf", "--lora.save_adapter_only", "true", "--checkpoint.last_save_in_hf")
    straight = train_layout(pools, 1, args, tmp_path / "straight")
    saved = tmp_path / "straight" / "checkpoint" / f"step-{SAVED}"
    assert json.loads((saved / ".complete").read_text())["trainable_only"]
    # The model part holds the adapters alone (7 pairs of rank 4 per block: 39 kB of the base's 0.6 MB at 2 blocks);
    # the optimizer state is theirs anyway (frozen parameters have none).
    model = {k: v for k, v in dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata.items()
             if k.startswith("model.")}
    assert len(model) == 2 * 7 * BLOCKS and all(is_adapter(k) for k in model), sorted(model)[:4]
    assert sum(v.size.numel() * 4 for v in model.values()) < _size(base) / 10

    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoint").mkdir(parents=True)
    shutil.copytree(saved, resumed_dir / "checkpoint" / saved.name)
    resumed = train_layout(pools, 1, args, resumed_dir)
    assert_continues_bitwise(resumed, straight, SAVED, STEPS)

    # The merged folder: every weight the base's, plus alpha / rank * B A where an adapter sits (in the Hugging Face
    # layout on both sides: the PEFT folder's B rows follow the base weight's rows).
    folder = tmp_path / "straight" / "checkpoint"
    base_sd, merged = _safetensors(base), _safetensors(folder / f"step-{STEPS}-hf")
    adapters = _safetensors(folder / f"step-{STEPS}-peft")
    config = json.loads((folder / f"step-{STEPS}-peft" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    deltas = {}
    for key, a in adapters.items():
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            deltas[f"{module}.weight"] = scale * (adapters[key.replace("lora_A", "lora_B")] @ a)
    assert len(deltas) == 7 * BLOCKS and set(merged) == set(base_sd)
    for key, weight in merged.items():
        expected = base_sd[key] + deltas[key] if key in deltas else base_sd[key]
        torch.testing.assert_close(weight, expected, rtol=1e-6, atol=1e-7, msg=key)
        assert key not in deltas or not torch.equal(weight, base_sd[key]), f"{key}: the adapter did not train"

    # PEFT loads the adapters onto the base folder and gives the merged model's logits.
    tokens = torch.randint(0, merged["model.embed_tokens.weight"].shape[0], (2, 16),
                           generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(hf, folder / f"step-{STEPS}-peft").eval()
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(folder / f"step-{STEPS}-hf",
                                                                     torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapters(tokens).logits, merged_model(tokens).logits, rtol=1e-4, atol=1e-4)


def test_adapter_only_checkpoint_resumes_in_another_layout(pools, tmp_path):
    """An adapter-only checkpoint saved under FSDP 2 (every adapter and its optimizer state sharded on rows) resumes
    under TP 2 (a column-wise base keeps A whole and shards B, a row-wise one shards A and keeps B whole), its base
    loaded by shard from the Hugging Face folder first: steps 3 and 4 continue the FSDP run's within the parity
    tolerances, every tensor compared (the frozen ones against the FSDP run's, which loaded the same base)."""
    base = tmp_path / "base"
    _base_hf(base)
    args = (*LORA, "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(SAVED),
            "--checkpoint.keep_latest_k", "0", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf", "--lora.save_adapter_only", "true")
    straight = train_layout(pools, 2, (*args, *dp(4, 2)), tmp_path / "fsdp2")
    saved = tmp_path / "fsdp2" / "checkpoint" / f"step-{SAVED}"
    assert json.loads((saved / ".complete").read_text())["trainable_only"]

    resumed_dir = tmp_path / "tp2"
    (resumed_dir / "checkpoint").mkdir(parents=True)
    shutil.copytree(saved, resumed_dir / "checkpoint" / saved.name)
    resumed = train_layout(pools, 2, (*args, *dp(8, 1), "--parallelism.tensor_parallel_degree", "2"), resumed_dir)
    assert [m["step"] for m in resumed["metrics"]] == list(range(SAVED + 1, STEPS + 1)), "must resume after step 2"
    expected = {**from_step(straight, SAVED + 1), "frozen": straight["frozen"]}
    problems = compare(resumed, expected)
    assert not problems, problems[:5]
