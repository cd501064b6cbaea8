"""torchrun entry point for the hang test: the real `torchtitan.train.main()`, except that on rank 1 the forward of
transformer block 1 in training step 3 never starts (the rank sleeps, as a rank stuck on a dead filesystem would).

The other rank then waits in FSDP's all-gather for block 1, a collective on a mesh subgroup. A global module hook
(a public torch API) injects the stall, so no production code is patched.
"""

from __future__ import annotations

import os
import time

import torch

from torchtitan.models.llama3.model import TransformerBlock
from torchtitan.train import main

_calls = 0


def _stall(module: torch.nn.Module, args) -> None:
    global _calls
    if isinstance(module, TransformerBlock) and module.layer_id == 1 and module.training:
        _calls += 1
        if _calls == 3 and os.environ.get("RANK") == "1":
            time.sleep(600)


if __name__ == "__main__":
    torch.nn.modules.module.register_module_forward_pre_hook(_stall)
    main()
