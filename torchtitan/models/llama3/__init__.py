"""Llama 3 / 3.1 / 3.2 dense decoder. Importing this package registers it without importing torch
(torchtitan/models/registry.py); the model itself is in model.py."""

from torchtitan.models.llama3.args import TransformerModelArgs, get_pipeline_unit_flops, llama3_flavors
from torchtitan.models.registry import ModelSpec, TorchSide, register_model_spec


def _torch_side() -> TorchSide:
    from torchtitan.models.llama3.hf_adapter import Llama3StateDictAdapter
    from torchtitan.models.llama3.model import Transformer, get_nparams_and_flops
    from torchtitan.models.llama3.parallelize import parallelize_llama, tp_block_plan

    return TorchSide(Transformer, parallelize_llama, get_nparams_and_flops, Llama3StateDictAdapter, tp_block_plan)


register_model_spec(
    ModelSpec(
        name="llama3",
        flavors=llama3_flavors,
        load_torch_side=_torch_side,
        pipeline_input_fqns=("tok_embeddings",),
        pipeline_output_fqns=("norm", "output"),
        pipeline_unit_flops_fn=get_pipeline_unit_flops,
    )
)

__all__ = ["TransformerModelArgs", "llama3_flavors"]
