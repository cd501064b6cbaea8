"""DeepSeek-V3 decoders: multi-head latent attention, dense first blocks, then mixture-of-experts blocks with
shared experts and sigmoid, group-limited, bias-balanced routing (16B Moonlight shape, 671B DeepSeek-V3).
Importing this package registers it without importing torch (torchtitan/models/registry.py); the model itself is
in model.py."""

from torchtitan.models.deepseek_v3.args import (
    DeepSeekV3ModelArgs,
    YaRNScaling,
    deepseek_v3_flavors,
    get_pipeline_unit_flops,
)
from torchtitan.models.registry import ModelSpec, TorchSide, register_model_spec


def _torch_side() -> TorchSide:
    from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Transformer, get_nparams_and_flops
    from torchtitan.models.deepseek_v3.parallelize import deepseek_tp_block_plan, parallelize_deepseek_v3

    return TorchSide(DeepSeekV3Transformer, parallelize_deepseek_v3, get_nparams_and_flops,
                     DeepSeekV3StateDictAdapter, deepseek_tp_block_plan)


register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        flavors=deepseek_v3_flavors,
        load_torch_side=_torch_side,
        pipeline_input_fqns=("tok_embeddings",),
        pipeline_output_fqns=("norm", "output"),
        pipeline_unit_flops_fn=get_pipeline_unit_flops,
    )
)

__all__ = ["DeepSeekV3ModelArgs", "YaRNScaling", "deepseek_v3_flavors"]
