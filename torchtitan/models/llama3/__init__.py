"""Llama 3 / 3.1 / 3.2 dense decoder."""

from torchtitan.models.llama3.args import TransformerModelArgs, llama3_flavors
from torchtitan.models.llama3.hf_adapter import Llama3StateDictAdapter
from torchtitan.models.llama3.model import Transformer, get_nparams_and_flops, get_pipeline_unit_flops
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.registry import ModelSpec, register_model_spec

register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=llama3_flavors,
        model_cls=Transformer,
        parallelize_fn=parallelize_llama,
        nparams_and_flops_fn=get_nparams_and_flops,
        state_dict_adapter=Llama3StateDictAdapter,
        pipeline_input_fqns=("tok_embeddings",),
        pipeline_output_fqns=("norm", "output"),
        pipeline_unit_flops_fn=get_pipeline_unit_flops,
    )
)

__all__ = ["Llama3StateDictAdapter", "Transformer", "TransformerModelArgs", "llama3_flavors", "parallelize_llama"]
