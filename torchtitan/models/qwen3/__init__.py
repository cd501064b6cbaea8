"""Qwen3 decoders: dense (0.6B-32B) and mixture-of-experts (30B-A3B, 235B-A22B)."""

from torchtitan.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3.model import Qwen3Transformer, get_nparams_and_flops, get_pipeline_unit_flops
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.registry import ModelSpec, register_model_spec

register_model_spec(
    ModelSpec(
        name="qwen3",
        flavors=qwen3_flavors,
        model_cls=Qwen3Transformer,
        parallelize_fn=parallelize_qwen3,
        nparams_and_flops_fn=get_nparams_and_flops,
        state_dict_adapter=Qwen3StateDictAdapter,
        pipeline_input_fqns=("tok_embeddings",),
        pipeline_output_fqns=("norm", "output"),
        pipeline_unit_flops_fn=get_pipeline_unit_flops,
    )
)

__all__ = ["Qwen3ModelArgs", "Qwen3StateDictAdapter", "Qwen3Transformer", "parallelize_qwen3", "qwen3_flavors"]
