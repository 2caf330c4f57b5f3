"""chunk_states_walk's reference: the state entering each chunk of packed rows, chunk by chunk, as
the backward's state walks see it (ssd/chunk_states_walk.py computes the same)."""
import torch

from ...core.tensors import expand_groups
from .chunks import chunked as chunked_tokens, chunked_sequences, cumsum_within_sequences, sequence_ranks


def chunk_entry_states(x, b, weight, log_decay, init, seq_idx, chunk_size, dtype):
    """The state entering each chunk of ``chunk_size`` tokens, [batch, chunks, heads, head_size,
    state_size] in ``dtype``: that of the sequence of the token before the chunk (a row's initial
    state enters its sequence 0). Chunk by chunk as the state pass at one chunk per segment:
    a chunk adds the tokens of the sequence it ends in, decayed to its end, and keeps the
    carried state, decayed through the chunk, only if that sequence began before it."""
    batch, tokens, heads, head_size = x.shape
    chunks = -(-tokens // chunk_size)

    def chunked(t):
        return chunked_tokens(t, chunk_size, dtype)

    xc, bc = chunked(x), chunked(expand_groups(b, heads))
    seq = chunked_sequences(seq_idx, x, chunk_size)
    rank, count = sequence_ranks(seq) if seq_idx is not None else (None, 1)
    w, g = chunked(weight), cumsum_within_sequences(chunked(log_decay), rank, count)  # [B, K, L, H]
    g_end = g[:, :, -1]                                                          # [B, K, H]
    end_seq = seq[:, :, -1:]
    before = torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], 1)                      # [B, K]
    # Selects, not multiplications by a 0/1 mask: no value of another sequence (NaN included)
    # enters a product.
    ends_here = (seq == end_seq)[..., None, None]                                # [B, K, L, 1, 1]
    xw = torch.where(ends_here, xc * (w * torch.exp(g_end[:, :, None] - g))[..., None], 0.0)
    local = torch.einsum("bklhp,bklhn->bkhpn", xw, torch.where(ends_here, bc, 0.0))
    carries = (before == end_seq[..., 0])[..., None, None, None]                 # [B, K, 1, 1, 1]
    state = torch.zeros(batch, heads, head_size, b.shape[3], dtype=dtype, device=x.device)
    if init is not None:
        state = torch.where((seq[:, 0, 0] == 0)[:, None, None, None], init.to(dtype), 0.0)
    entries = []
    for k in range(chunks):
        entries.append(state)
        state = torch.where(carries[:, k], torch.exp(g_end[:, k])[..., None, None] * state, 0.0) + local[:, k]
    return torch.stack(entries, 1)
