"""Qwen3 decoders: dense (0.6B-32B) and mixture-of-experts (30B-A3B, 235B-A22B). Importing this package registers
it without importing torch (torchtitan/models/registry.py); the model itself is in model.py."""

from torchtitan.models.qwen3.args import Qwen3ModelArgs, get_pipeline_unit_flops, qwen3_flavors
from torchtitan.models.registry import ModelSpec, TorchSide, register_model_spec


def _torch_side() -> TorchSide:
    from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
    from torchtitan.models.qwen3.model import Qwen3Transformer, get_nparams_and_flops
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3, qwen3_tp_block_plan

    return TorchSide(Qwen3Transformer, parallelize_qwen3, get_nparams_and_flops, Qwen3StateDictAdapter,
                     qwen3_tp_block_plan)


register_model_spec(
    ModelSpec(
        name="qwen3",
        flavors=qwen3_flavors,
        load_torch_side=_torch_side,
        pipeline_input_fqns=("tok_embeddings",),
        pipeline_output_fqns=("norm", "output"),
        pipeline_unit_flops_fn=get_pipeline_unit_flops,
    )
)

__all__ = ["Qwen3ModelArgs", "qwen3_flavors"]
