"""Document masking (model.attn_mask_type = "block_causal"): the mask, a document's logits independent of its
neighbours in the pack, context-parallel attention with documents against one process, and the config key.

Whole-trainer parity of block-causal layouts (CP, TP, PP, FSDP) is in tests/integration/layouts.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.unit.forked import run_ranks
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import load_config
from torchtitan.data.dataloader import document_ids_from_positions
from torchtitan.distributed.context_parallel import AllGatherKVAttention, sequence_positions
from torchtitan.models.attention import document_causal_mask
from torchtitan.models.llama3.args import llama3_flavors
from torchtitan.models.llama3.model import Transformer


def _docs(lengths: list[int], batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, document ids) of one row packed with documents of these lengths, as the dataloader gives them."""
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(batch, -1).contiguous()
    return positions, document_ids_from_positions(positions)


def test_mask_is_causal_within_each_document():
    _, docs = _docs([3, 1, 4])
    mask = document_causal_mask(docs, docs)[0, 0]
    want = torch.tensor([[i >= j and int(docs[0, i]) == int(docs[0, j]) for j in range(8)] for i in range(8)])
    assert torch.equal(mask, want)
    # the queries as the last chunk of the keys' sequence: the bottom rows of the same mask
    assert torch.equal(document_causal_mask(docs[:, 5:], docs)[0, 0], want[5:])


def test_document_ids_restart_where_positions_do():
    positions = torch.tensor([[5, 6, 0, 1, 2, 0, 0, 1]])  # a row that starts inside a document
    assert document_ids_from_positions(positions).tolist() == [[1, 1, 2, 2, 2, 3, 4, 4]]


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(llama3_flavors["debugmodel_small"]).double()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


@torch.no_grad()
def test_a_documents_logits_do_not_depend_on_its_neighbours():
    """Document A packed after neighbours of other lengths and contents gives the logits it gives alone; with plain
    causal attention it does not (so the comparison can fail)."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(0, 512, (1, 11), generator=g)
    alone = model(doc, *_docs([11]))
    for before, after in ((5, 8), (17, 1), (0, 20)):
        tokens = torch.cat([torch.randint(0, 512, (1, before), generator=g), doc,
                            torch.randint(0, 512, (1, after), generator=g)], dim=1)
        lengths = [n for n in (before, 11, after) if n]
        packed = model(tokens, *_docs(lengths))
        torch.testing.assert_close(packed[:, before:before + 11], alone, rtol=1e-10, atol=1e-10)
        if before:
            causal = model(tokens)
            assert not torch.allclose(causal[:, before:before + 11], alone, rtol=1e-3, atol=1e-3)


def test_documents_in_a_batch_are_masked_per_row():
    """Each row has its own documents: a batch of two packs equals each row run alone."""
    model = _model()
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    rows = [_docs([4, 8]), _docs([7, 2, 3])]
    positions, docs = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    with torch.no_grad():
        both = model(tokens, positions, docs)
        for i, (pos, ids) in enumerate(rows):
            torch.testing.assert_close(both[i:i + 1], model(tokens[i:i + 1], pos, ids), rtol=1e-10, atol=1e-10)


def _qkv(seq: int = 32):
    g = torch.Generator().manual_seed(3)
    shapes = ((2, 4, seq, 8), (2, 2, seq, 8), (2, 2, seq, 8), (2, 4, seq, 8))
    return tuple(torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)


# Two rows with different documents; some end inside a cp chunk, one spans several chunks.
_ROW_LENGTHS = ([5, 9, 1, 17], [20, 3, 9])


def _batch_docs() -> torch.Tensor:
    return torch.cat([_docs(lengths)[1] for lengths in _ROW_LENGTHS])


def _full_attention():
    q, k, v, weight = (t.requires_grad_(True) if i < 3 else t for i, t in enumerate(_qkv()))
    mask = document_causal_mask(_batch_docs(), _batch_docs())
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_attention_rank(rank: int, cp: int):
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    q, k, v, weight = _qkv()
    index = sequence_positions(q.shape[2], cp, rank)
    local = [t[:, :, index].clone().requires_grad_(True) for t in (q, k, v)]
    out = AllGatherKVAttention(mesh)(*local, _batch_docs())
    (out * weight[:, :, index]).sum().backward()
    return index, out.detach(), *(t.grad for t in local)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_with_documents_matches_one_process(cp):
    out, dq, dk, dv = _full_attention()
    for index, *got in run_ranks(_cp_attention_rank, cp, world=cp):
        for name, want, have in zip(("output", "dq", "dk", "dv"), (out, dq, dk, dv), got, strict=True):
            have = torch.tensor(have, dtype=torch.float64)  # ranks send plain lists (tests/unit/forked.py)
            torch.testing.assert_close(have, want[:, :, index], rtol=1e-10, atol=1e-10, msg=name)


def test_unknown_mask_type_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as info:
        load_config(["--model.attn_mask_type", "sliding"], 1)
    assert str(info.value) == "model.attn_mask_type: 'sliding' is not one of causal, block_causal"
