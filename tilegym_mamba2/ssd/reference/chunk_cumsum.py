"""chunk_cumsum's reference: the in-chunk cumulative sums of a * dt, in base 2 (ssd/chunk_cumsum.py
computes the same)."""
from __future__ import annotations

import torch

from ...core.constants import LOG2E
from ...core.tensors import log_decay
from .chunks import chunked


def decay_cumsum_reference(
    a: torch.Tensor,
    dt: torch.Tensor,
    chunk_size: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Per-chunk inclusive cumsum of ``a * dt`` (core.tensors.log_decay's limits), scaled by LOG2E.

    a [H], dt [B, T, H] -> [B, H, K * L]. Padded tokens have dt = 0, so the
    cumsum stays flat after the last real token.
    """
    dtc = chunked(dt, chunk_size, dtype)  # [B, K, L, H]
    g = log_decay(a.to(dtype), dtc).cumsum(dim=2) * LOG2E
    batch, num_chunks, _, heads = g.shape
    return g.permute(0, 3, 1, 2).reshape(batch, heads, num_chunks * chunk_size)
