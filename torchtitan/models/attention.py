"""Attention masks shared by every model family (plain tensors; no torch.distributed)."""

from __future__ import annotations

import torch


def document_causal_mask(query_docs: torch.Tensor, key_docs: torch.Tensor) -> torch.Tensor:
    """[batch, 1, queries, keys] boolean mask: a query sees the keys of its own document, causally.

    `key_docs` [batch, keys] holds the document id of each key of a sequence; the queries are its last
    `query_docs.shape[1]` positions (all of it, or one chunk of it under context parallel), `query_docs` their ids.
    """
    n_q, n_k = query_docs.shape[1], key_docs.shape[1]
    key_pos = torch.arange(n_k, device=key_docs.device)
    query_pos = torch.arange(n_k - n_q, n_k, device=key_docs.device)
    causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    return (causal & (query_docs.unsqueeze(2) == key_docs.unsqueeze(1))).unsqueeze(1)

