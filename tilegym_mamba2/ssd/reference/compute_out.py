"""compute_out's reference: Y = exp(G) C h + (exp(G - G^T) o C B^T o causal) (dt X) + D X, chunk by
chunk from the entering states (ssd/compute_out.py computes the same)."""
from __future__ import annotations

import math

import torch

from ...core.tensors import expand_groups
from .chunks import chunked, chunked_decay


def chunk_output_reference(
    x: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt: torch.Tensor,
    decay_cumsum: torch.Tensor,
    chunk_states: torch.Tensor,
    chunk_size: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Outputs from the entering states plus the causal in-chunk mixing.

    x [B, T, H, P], b and c [B, T, G, N], d [H], dt [B, T, H],
    decay_cumsum [B, H, K * L], chunk_states [B, H, K, P, N] (None: zeros) -> out [B, T, H, P].

    y_t = exp2(g_t) S_k c_t + sum_{s <= t in chunk} exp2(g_t - g_s) (c_t . b_s) dt_s x_s + d x_t
    """
    batch, tokens, heads, head_size = x.shape
    xc = chunked(x, chunk_size, dtype)  # [B, K, L, H, P]
    bc = chunked(expand_groups(b, heads), chunk_size, dtype)  # [B, K, L, H, N]
    cc = chunked(expand_groups(c, heads), chunk_size, dtype)  # [B, K, L, H, N]
    dtc = chunked(dt, chunk_size, dtype)  # [B, K, L, H]
    g = chunked_decay(decay_cumsum, chunk_size, dtype)  # [B, K, L, H]

    inter = 0.0
    if chunk_states is not None:
        inter = torch.exp2(g)[..., None] * torch.einsum("bklhn,bhkpn->bklhp", cc, chunk_states.to(dtype))

    # Mask before exp2: for s > t the exponent is positive and could overflow
    # to inf, and inf * 0 would poison the sum with NaN.
    gh = g.permute(0, 1, 3, 2)  # [B, K, H, L]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp2((gh[..., :, None] - gh[..., None, :]).masked_fill(~causal, -math.inf))
    scores = torch.einsum("bkthn,bkshn->bkhts", cc, bc) * decay * dtc.permute(0, 1, 3, 2)[..., None, :]
    intra = torch.einsum("bkhts,bkshp->bkthp", scores, xc)

    out = (intra + inter).reshape(batch, -1, heads, head_size)[:, :tokens]
    return out + d.to(dtype)[:, None] * x.to(dtype)
