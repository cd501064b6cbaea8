"""The [moe] config section (torchtitan/config/moe.py): overrides of the flavor's balance settings, filled in from the
flavor when unset, checked to one-line errors, refused on dense models; the balance loss under tensor and context
parallel."""

from __future__ import annotations

import dataclasses

import pytest

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import load_config, to_dict
from torchtitan.models.registry import get_model_spec

MOE_SMALL = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small"]
MOE_AUX = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small_aux"]
DENSE = ["--model.name", "llama3", "--model.flavor", "debugmodel"]


def _error(argv: list[str], world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, world_size)
    msg = str(info.value)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)
    return msg


def _model_args(cfg):
    from torchtitan.components.model_parts import model_args_for  # lazy: pulls in torch

    return model_args_for(cfg)


def test_moe_keys_override_the_flavor_everywhere():
    flavor = get_model_spec("qwen3").flavors["debugmodel_moe_small"].moe
    original = dataclasses.asdict(flavor)
    assert (flavor.aux_loss_coeff, flavor.aux_loss_scope, flavor.router_z_loss_coeff) == (0.0, "sequence", 0.0)
    assert flavor.load_balance_coeff > 0
    cfg, _ = load_config([*MOE_SMALL, "--moe.aux_loss_coeff", "0.5", "--moe.aux_loss_scope", "global_batch",
                          "--moe.router_z_loss_coeff", "1e-3", "--moe.load_balance_coeff", "0"], 1)
    want = {"aux_loss_coeff": 0.5, "aux_loss_scope": "global_batch", "router_z_loss_coeff": 1e-3,
            "load_balance_coeff": 0.0}
    moe_args = _model_args(cfg).moe
    saved = to_dict(cfg)["moe"]  # what job_config.json records
    for key, value in want.items():
        assert getattr(cfg.moe, key) == value
        assert getattr(moe_args, key) == value
        assert saved[key] == value
    # the rest of the flavor's MoEArgs is untouched
    assert dataclasses.replace(moe_args, **{k: getattr(flavor, k) for k in want}) == flavor
    # the flavor itself is not modified
    assert dataclasses.asdict(get_model_spec("qwen3").flavors["debugmodel_moe_small"].moe) == original


def test_unset_moe_keys_come_out_as_the_flavors_values():
    flavor = get_model_spec("qwen3").flavors["debugmodel_moe_small_aux"].moe
    cfg, _ = load_config([*MOE_AUX, "--moe.router_z_loss_coeff", "0.01"], 1)
    saved = to_dict(cfg)["moe"]
    assert saved["load_balance_coeff"] == flavor.load_balance_coeff
    assert saved["aux_loss_coeff"] == flavor.aux_loss_coeff == 1.0
    assert saved["aux_loss_scope"] == flavor.aux_loss_scope
    assert saved["router_z_loss_coeff"] == 0.01
    assert _model_args(cfg).moe == dataclasses.replace(flavor, router_z_loss_coeff=0.01)
    # resolving the resolved config again changes nothing
    again, _ = load_config([*MOE_AUX, "--moe.router_z_loss_coeff", "0.01", "--moe.aux_loss_coeff",
                            str(saved["aux_loss_coeff"]), "--moe.aux_loss_scope", saved["aux_loss_scope"]], 1)
    assert to_dict(again)["moe"] == saved


def test_dense_model_keeps_the_moe_keys_unset():
    cfg, _ = load_config(DENSE, 1)
    assert all(to_dict(cfg)["moe"][k] is None for k in ("load_balance_coeff", "aux_loss_coeff", "aux_loss_scope",
                                                        "router_z_loss_coeff"))


@pytest.mark.parametrize("key", ["aux_loss_coeff", "router_z_loss_coeff", "load_balance_coeff"])
def test_negative_coefficient_is_an_error(key):
    msg = _error([*MOE_SMALL, f"--moe.{key}=-0.5"])
    assert msg.startswith(f"moe.{key}") and "-0.5" in msg


def test_unknown_scope_is_an_error_listing_the_scopes():
    msg = _error([*MOE_SMALL, "--moe.aux_loss_scope", "batch"])
    assert msg.startswith("moe.aux_loss_scope") and "'batch'" in msg
    for scope in ("sequence", "microbatch", "global_batch"):
        assert scope in msg


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_collapse_fraction_outside_zero_one_is_an_error(value):
    msg = _error([*MOE_SMALL, "--moe.collapse_load_fraction", value])
    assert msg.startswith("moe.collapse_load_fraction") and value in msg


@pytest.mark.parametrize("key", ["collapse_warn_after_steps", "collapse_warn_every_steps"])
def test_collapse_steps_below_one_are_an_error(key):
    assert _error([*MOE_SMALL, f"--moe.{key}", "0"]).startswith(f"moe.{key}")


@pytest.mark.parametrize("value", ["0", "1", "0.0"])
def test_collapse_fraction_bounds_are_accepted(value):
    cfg, _ = load_config([*MOE_SMALL, "--moe.collapse_load_fraction", value], 1)
    assert cfg.moe.collapse_load_fraction == float(value)


@pytest.mark.parametrize(("key", "value"), [
    ("aux_loss_coeff", "0.1"), ("aux_loss_coeff", "0"), ("aux_loss_scope", "sequence"),
    ("router_z_loss_coeff", "1e-3"), ("load_balance_coeff", "0.001"), ("collapse_load_fraction", "0.5"),
    ("collapse_warn_after_steps", "3"), ("collapse_warn_every_steps", "7"),
])
def test_moe_key_on_a_dense_model_is_an_error(key, value):
    msg = _error([*DENSE, f"--moe.{key}", value])
    assert msg.startswith(f"moe.{key}") and "llama3/debugmodel" in msg and "no MoE layers" in msg


def test_moe_key_on_a_dense_model_from_toml_names_the_file(tmp_path):
    path = tmp_path / "dense.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n[moe]\naux_loss_coeff = 0.1\n')
    msg = _error(["--job.config_file", str(path)])
    assert str(path) in msg and "moe.aux_loss_coeff" in msg and "no MoE layers" in msg


@pytest.mark.parametrize("extra", [
    ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64"],
    ["--parallelism.context_parallel_degree", "2"],
    ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "64"],
])
@pytest.mark.parametrize("scope", ["sequence", "microbatch", "global_batch"])
def test_balance_loss_is_accepted_with_tensor_and_context_parallel(extra, scope):
    cfg, resolved = load_config([*MOE_AUX, "--moe.aux_loss_scope", scope, *extra], 2)
    assert resolved.parallel_dims.tp * resolved.parallel_dims.cp == 2
    moe_args = _model_args(cfg).moe
    assert moe_args.aux_loss_coeff == 1.0 and moe_args.aux_loss_scope == scope
