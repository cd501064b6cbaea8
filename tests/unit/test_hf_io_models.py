"""Hugging Face folders (torchtitan/components/hf_io.py) for models other than Llama: Qwen3 dense and MoE through
`save_hf` / `load_hf`, transformers' `AutoModelForCausalLM`, the trainer's CheckpointManager exports and
scripts/convert_checkpoint.py; plus how hf_io picks a model's adapter. Fully offline: models built from configs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

import torch.distributed.checkpoint as dcp  # noqa: E402

from torchtitan.components import checkpoint_io as cio  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager, TrainState  # noqa: E402
from torchtitan.components.hf_io import adapter_for, load_hf, save_hf  # noqa: E402
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.models.llama3.args import llama3_flavors  # noqa: E402
from torchtitan.models.llama3.hf_adapter import Llama3StateDictAdapter  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402
from torchtitan.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors  # noqa: E402
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Transformer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The registry's debug flavors, shrunk (vocab, depth) so that building, saving and two forwards stay well under
# a second each; every other setting (head_dim != dim / n_heads, GQA, 8 experts with balancing) is the flavor's.
SMALL = {name: dataclasses.replace(qwen3_flavors[name], vocab_size=1024, n_layers=2)
         for name in ("debugmodel", "debugmodel_moe")}
TOL = 1e-4


def _qwen3(args: Qwen3ModelArgs, seed: int = 0) -> Qwen3Transformer:
    """Our model with weights that make logit parity meaningful: at the default init the norms are all ones (a
    swapped or dropped norm would not show) and the router's logits are so flat that any routing looks alike."""
    torch.manual_seed(seed)
    model = Qwen3Transformer(args)
    model.init_weights()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "router" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.eval()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key


def _without_bias(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Args read from config.json alone have no load balancing (Hugging Face has no routing bias), so a state dict
    imported with them has no `expert_bias` buffers; with the flavor's args they come back as zeros."""
    return {k: v for k, v in sd.items() if not k.endswith("expert_bias")}


@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")  # once per module: the import alone takes seconds


# ---------------------------------------------------------------------------------------------
# Qwen3 through save_hf / transformers / load_hf
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", list(SMALL))
def test_qwen3_export_matches_transformers_and_loads_back(transformers_mod, tmp_path: Path, flavor: str) -> None:
    args = SMALL[flavor]
    model = _qwen3(args)
    ref = model.state_dict()
    moe = bool(args.moe_layer_ids)
    # The MoE model goes through the sharded layout (index + shards), the dense one through a single file.
    out = save_hf(tmp_path / "hf", ref, args, model="qwen3", max_shard_bytes=1_000_000 if moe else 5 * 1024**3)
    assert (out / "model.safetensors.index.json").is_file() == moe
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_moe" if moe else "qwen3")

    hf = transformers_mod.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf.eval()(tokens).logits - model(tokens)).abs().max().item()
    assert diff <= TOL, f"{flavor}: max |logit diff| {diff:.3g}"

    loaded, given = load_hf(out, args, model="qwen3")
    assert given is args
    _assert_same(loaded, ref)  # expert_bias is zero here, which is also what an import gives
    # Without any hint the folder is recognised as Qwen3 from config.json.
    loaded, found = load_hf(out)
    assert isinstance(found, Qwen3ModelArgs)
    Qwen3StateDictAdapter.check_args_match(args, found, "detected")
    _assert_same(loaded, _without_bias(ref))


def test_trainer_checkpoint_manager_exports_and_imports_qwen3_moe(tmp_path: Path) -> None:
    """checkpoint.last_save_in_hf and checkpoint.initial_load_in_hf on one process, for a model other than Llama."""
    args = SMALL["debugmodel_moe"]
    model = _qwen3(args)
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    def manager(cfg: Checkpoint, part: torch.nn.Module) -> CheckpointManager:
        return CheckpointManager(cfg, dump_folder=tmp_path, model_parts=[part], optimizer=None, lr_scheduler=None,
                                 dataloader=None, train_state=TrainState(), model_args=args, world_size=1, rank=0)

    mgr = manager(Checkpoint(enable=True, last_save_model_only=False, last_save_in_hf=True), model)
    mgr.maybe_save(1, last_step=True)
    mgr.close()
    hf_dir = tmp_path / "checkpoint" / "step-1-hf"
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen3_moe"
    _assert_same(load_hf(hf_dir, args)[0], ref)

    fresh = Qwen3Transformer(args)  # other random weights until the import
    mgr = manager(Checkpoint(initial_load_path=str(hf_dir), initial_load_in_hf=True), fresh)
    assert mgr.load()
    mgr.close()
    _assert_same(fresh.state_dict(), ref)


def test_convert_script_round_trip_for_qwen3_moe(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    args = qwen3_flavors["debugmodel_moe"]  # the script takes registry flavors as they are
    want = _qwen3(args).state_dict()
    step = tmp_path / "step-3"
    dcp.save({"model": want}, checkpoint_id=str(step), no_dist=True)
    cio.write_marker(step, {"step": 3, "world_size": 1, "model_only": True})

    hf_dir = tmp_path / "hf"
    # --no-tokenizer: the default tokenizer would be built in the user's cache (TORCHTITAN_CACHE_DIR), outside tmp_path;
    # test_hf_adapter.py exports the tokenizer.
    argv = ["dcp-to-hf", str(step), str(hf_dir), "--model", "qwen3", "--flavor", "debugmodel_moe", "--no-tokenizer"]
    assert conv.main([*argv, "--dtype", "float32"]) == 0
    _assert_same(load_hf(hf_dir, args)[0], want)
    assert not (hf_dir / "tokenizer.json").exists() and not (hf_dir / "generation_config.json").exists()
    # No --model: config.json says which model it is.
    assert conv.main(["hf-to-dcp", str(hf_dir), str(tmp_path / "back" / "step-0")]) == 0
    _assert_same(cio.load_full_model_state(tmp_path / "back" / "step-0"), _without_bias(want))
    # With the flavor, the zero routing biases a balancing model needs to load the folder are written too.
    assert conv.main(["hf-to-dcp", str(hf_dir), str(tmp_path / "b2"), "--model", "qwen3", "--flavor",
                      "debugmodel_moe"]) == 0
    _assert_same(cio.load_full_model_state(tmp_path / "b2"), want)
    capsys.readouterr()

    # A Qwen3 checkpoint converted as the default llama3, a flavor that does not match, a flavor without a model.
    assert conv.main(["dcp-to-hf", str(step), str(tmp_path / "o"), "--flavor", "debugmodel"]) == 2
    assert conv.main(["hf-to-dcp", str(hf_dir), str(tmp_path / "b3"), "--model", "qwen3", "--flavor",
                      "debugmodel"]) == 2
    assert conv.main(["hf-to-dcp", str(hf_dir), str(tmp_path / "b4"), "--flavor", "debugmodel_moe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    assert "--model llama3" in err[0] and "moe layers" in err[1] and "--model" in err[2]
    assert not (tmp_path / "o").exists() and not (tmp_path / "b3").exists()


# ---------------------------------------------------------------------------------------------
# Choosing the adapter
# ---------------------------------------------------------------------------------------------


def test_adapter_for_names_classes_and_args() -> None:
    assert adapter_for("qwen3") is Qwen3StateDictAdapter
    assert adapter_for("llama3") is Llama3StateDictAdapter
    assert adapter_for(Qwen3StateDictAdapter) is Qwen3StateDictAdapter  # a class is used as is
    assert adapter_for(model_args=SMALL["debugmodel"]) is Qwen3StateDictAdapter
    assert adapter_for(model_args=llama3_flavors["debugmodel"]) is Llama3StateDictAdapter
    with pytest.raises(KeyError, match="unknown model.name 'gpt2'"):
        adapter_for("gpt2")
    with pytest.raises(ValueError, match="no model with an adapter registered for model args of type dict"):
        adapter_for(model_args={"dim": 4})
    with pytest.raises(ValueError, match="pass model="):
        adapter_for()


def test_load_hf_errors_name_the_model(tmp_path: Path) -> None:
    args = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=1, vocab_size=256)
    torch.manual_seed(0)
    llama = Transformer(args)
    llama.init_weights()
    out = save_hf(tmp_path / "llama", llama.state_dict(), args)  # the model found from the args' class
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(ValueError, match="model_type 'llama' is not 'qwen3'"):
        load_hf(out, model="qwen3")
    with pytest.raises(TypeError, match="model_args is a Qwen3ModelArgs"):
        load_hf(out, SMALL["debugmodel"], model="llama3")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    # Auto-detection: no adapter reads it, and the message carries each model's reason.
    with pytest.raises(ValueError, match="no registered model reads this config") as info:
        load_hf(out)
    assert "llama3: model_type 'mistral' is not 'llama'" in str(info.value) and "qwen3: model_type" in str(info.value)


def test_deepseek_v3_routing_bias_stays_float32_in_a_bfloat16_export(tmp_path):
    """The routing bias moves in steps of 1e-3, below bfloat16's resolution near 1: a bf16 export keeps it float32
    (as the published DeepSeek-V3 checkpoints do) and the weights bf16."""
    import dataclasses

    import torch
    from safetensors.torch import load_file

    from torchtitan.components.hf_io import save_hf
    from torchtitan.models.deepseek_v3 import deepseek_v3_flavors
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Transformer

    args = dataclasses.replace(deepseek_v3_flavors["debugmodel"], vocab_size=256, n_layers=2, max_seq_len=16)
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(args)
    model.init_weights()
    bias = next(m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None)
    with torch.no_grad():
        bias.copy_(1.0 + 1e-3 * torch.arange(bias.numel()))
    folder = save_hf(tmp_path / "hf", model.state_dict(), args, dtype="bfloat16", model="deepseek_v3")
    tensors = load_file(str(folder / "model.safetensors"))
    [key] = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert tensors[key].dtype == torch.float32 and torch.equal(tensors[key], bias)
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
