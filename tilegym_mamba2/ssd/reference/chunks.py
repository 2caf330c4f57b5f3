"""Helpers every reference stage uses: tokens cut into chunks of the kernels' layout, and the
sequence bookkeeping of packed rows inside a chunk (each token's sequence's rank, sums that restart
at a sequence's first token)."""
import torch
import torch.nn.functional as F


def chunked(t: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, ...] -> [B, K, L, ...], zero-padding the ragged last chunk.

    Zero padding is harmless: dt = 0 means no decay and no input, and b = c = 0
    means padded tokens neither write to nor read from the state.
    """
    num_tokens = t.shape[1]
    num_chunks = -(-num_tokens // chunk_size)
    pad = num_chunks * chunk_size - num_tokens
    t = t.to(dtype)
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], num_chunks, chunk_size, *t.shape[2:])


def chunked_decay(decay_cumsum: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, K * L] -> [B, K, L, H] so it lines up with the chunked token tensors."""
    batch, heads, padded = decay_cumsum.shape
    g = decay_cumsum.to(dtype).reshape(batch, heads, padded // chunk_size, chunk_size)
    return g.permute(0, 2, 3, 1)


def chunked_sequences(seq_idx, x, chunk_size):
    """Each token's sequence, [batch, chunks, chunk_size] (padding repeats the last token's)."""
    batch, tokens = x.shape[:2]
    pad = -tokens % chunk_size
    if seq_idx is None:
        seq = torch.zeros(batch, tokens + pad, dtype=torch.long, device=x.device)
    else:
        seq = torch.cat([seq_idx.long(), seq_idx[:, -1:].long().expand(-1, pad)], 1)
    return seq.reshape(batch, -1, chunk_size)


def sequence_ranks(seq):
    """[B, K, L] sequence ids per chunk -> (each token's sequence's rank among its chunk's
    sequences, the largest number of sequences in a chunk)."""
    changes = torch.cat([torch.zeros_like(seq[..., :1]), (seq[..., 1:] != seq[..., :-1]).long()], -1)
    rank = changes.cumsum(-1)
    return rank, int(rank.max()) + 1


def cumsum_within_sequences(values, rank, count):
    """The in-chunk cumulative sum along tokens (dim 2) of each sequence on its own: a sum that
    ran across a boundary would carry one sequence's values (a NaN) into the next one's."""
    if count == 1:
        return values.cumsum(2)
    out = torch.zeros_like(values)
    for j in range(count):
        mine = (rank == j)[..., None]
        out = torch.where(mine, torch.where(mine, values, 0.0).cumsum(2), out)
    return out


def within_sequences(rank, count, equation, pairs, tokens, pair_axis):
    """einsum(equation, pairs, tokens) where ``pairs`` [.., t, s] is zero between sequences:
    ``tokens`` (over the contracted index, its token dimension at 2) is restricted to one
    sequence of the chunk at a time and each result selected to the tokens of that sequence
    (pair_axis: which of the result's dimensions is the token one), so that a non-finite value
    of one sequence never meets a zero of another's."""
    if count == 1:
        return torch.einsum(equation, pairs, tokens)
    out = 0.0
    for j in range(count):
        mine = (rank == j)                                                           # [B, K, L]
        shape = mine.shape + (1,) * (tokens.ndim - 3)
        part = torch.einsum(equation, pairs, torch.where(mine.view(shape), tokens, 0.0))
        keep = mine.view(mine.shape[:2] + (1,) * (pair_axis - 2) + mine.shape[2:] + (1,) * (part.ndim - pair_axis - 1))
        out = out + torch.where(keep, part, 0.0)
    return out
