"""DeepSeek-V3 decoders: multi-head latent attention, dense first blocks, then mixture-of-experts blocks with
shared experts and sigmoid, group-limited, bias-balanced routing (16B Moonlight shape, 671B DeepSeek-V3)."""

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, YaRNScaling, deepseek_v3_flavors
from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.deepseek_v3.model import DeepSeekV3Transformer, get_nparams_and_flops, get_pipeline_unit_flops
from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseek_v3
from torchtitan.models.registry import ModelSpec, register_model_spec

register_model_spec(
    ModelSpec(
        name="deepseek_v3",
        flavors=deepseek_v3_flavors,
        model_cls=DeepSeekV3Transformer,
        parallelize_fn=parallelize_deepseek_v3,
        nparams_and_flops_fn=get_nparams_and_flops,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
        pipeline_input_fqns=("tok_embeddings",),
        pipeline_output_fqns=("norm", "output"),
        pipeline_unit_flops_fn=get_pipeline_unit_flops,
    )
)

__all__ = ["DeepSeekV3ModelArgs", "DeepSeekV3StateDictAdapter", "DeepSeekV3Transformer", "YaRNScaling",
           "deepseek_v3_flavors", "parallelize_deepseek_v3"]
