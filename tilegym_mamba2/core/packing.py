"""Packed sequences (``seq_idx`` / ``cu_seqlens``) and mamba_ssm's return convention."""
import torch


def seq_idx_from_cu_seqlens(cu_seqlens, tokens):
    """[num_sequences + 1] start offsets -> [1, tokens] sequence index of each token."""
    # Token t is in the sequence whose end is the first one past t. No read of cu_seqlens on the
    # host, and defined (if meaningless) for invalid offsets, which the checks report.
    tokens_range = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens_range, right=True).to(torch.int32)[None]


def per_sequence_init(initial_states, cu_seqlens, batch) -> bool:
    """Whether packed sequences start from initial states of their own ([num_sequences, ...] with
    cu_seqlens), not from their row's."""
    return initial_states is not None and cu_seqlens is not None and initial_states.shape[0] != batch


def sequence_runs(seq_idx, batch, tokens):
    """-> per batch row, a list of (start, end, sequence id) token ranges (host lists)."""
    if seq_idx is None:
        return [[(0, tokens, 0)] for _ in range(batch)]
    runs = []
    for row in seq_idx.cpu().tolist():
        starts = [0] + [t for t in range(1, tokens) if row[t] != row[t - 1]]
        runs.append([(s, e, row[s]) for s, e in zip(starts, starts[1:] + [tokens])])
    return runs


def sequences(seq_idx, cu_seqlens, initial_states, batch, tokens):
    """Yields (row, start, end, starting state or None) for every packed sequence. A sequence
    starts from its own initial state ([num_sequences, ...] with cu_seqlens), from its row's
    when its id is 0 (mamba_ssm's rule), else from zeros."""
    if seq_idx is None and cu_seqlens is not None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, tokens)
    num_seqs = None if cu_seqlens is None else cu_seqlens.numel() - 1
    per_sequence = (initial_states is not None and num_seqs is not None and num_seqs != batch
                    and initial_states.shape[0] == num_seqs)
    for row, runs in enumerate(sequence_runs(seq_idx, batch, tokens)):
        for run, (start, end, seq_id) in enumerate(runs):
            if initial_states is None:
                init = None
            elif per_sequence:
                init = initial_states[run][None]
            else:
                init = initial_states[row][None] if run == 0 and seq_id == 0 else None
            yield row, start, end, init


def packed_sequences(seq_idx, cu_seqlens, batch, tokens):
    """Every packed sequence, in order, as host lists (rows, starts, lengths, ids): one device
    read for the whole call, whatever the number of sequences."""
    if seq_idx is None and cu_seqlens is None:
        return [*range(batch)], [0] * batch, [tokens] * batch, [0] * batch
    if seq_idx is None:
        offsets = cu_seqlens.tolist()
        count = len(offsets) - 1
        return [0] * count, offsets[:-1], [e - s for s, e in zip(offsets[:-1], offsets[1:])], [*range(count)]
    seq = seq_idx.long()
    change = torch.ones(batch, tokens, dtype=torch.bool, device=seq.device)
    change[:, 1:] = seq[:, 1:] != seq[:, :-1]
    first = change.flatten().nonzero().flatten()
    flat, ids = torch.stack([first, seq.flatten()[first]]).tolist()
    ends = flat[1:] + [batch * tokens]
    rows = [f // tokens for f in flat]
    starts = [f % tokens for f in flat]
    # A sequence ends at the next one's start, or at its row's end.
    lengths = [min(e, (r + 1) * tokens) - f for f, e, r in zip(flat, ends, rows)]
    return rows, starts, lengths, ids


class SequenceBuckets:
    """Packed sequences regrouped as rows of their own: the sequences whose length rounds up to
    one power of two L form a bucket [n, L, ...], zero-padded past each sequence's end. A scan
    over the buckets costs what the tokens cost (at most twice, in padding) in a handful of
    launches, where a loop over sequences costs a host round per sequence. Zero padding is
    inert: no weight, no decay, no input."""

    def __init__(self, rows, starts, lengths, tokens, device):
        self.tokens = tokens
        by_length = {}
        for k, length in enumerate(lengths):
            by_length.setdefault(1 << (length - 1).bit_length(), []).append(k)
        self.buckets = []
        for length, members in sorted(by_length.items()):
            members_t = torch.tensor(members, dtype=torch.long, device=device)
            first = torch.tensor([rows[k] * tokens + starts[k] for k in members], dtype=torch.long, device=device)
            size = torch.tensor([lengths[k] for k in members], dtype=torch.long, device=device)
            offsets = torch.arange(length, dtype=torch.long, device=device)
            valid = offsets[None] < size[:, None]
            index = torch.where(valid, first[:, None] + offsets[None], 0)
            self.buckets.append((members_t, index, valid))

    def gather(self, t, bucket):
        """[batch, tokens, ...] -> the bucket's [n, L, ...], zeros past each sequence's end."""
        _, index, valid = bucket
        flat = t.reshape(-1, *t.shape[2:])
        rows = flat[index]
        return torch.where(valid.view(*valid.shape, *(1,) * (rows.ndim - 2)), rows, torch.zeros((), dtype=rows.dtype,
                                                                                                  device=rows.device))

    def scatter(self, out, bucket, values):
        """Writes the bucket's [n, L, ...] ``values`` into ``out`` [batch, tokens, ...] at its tokens."""
        _, index, valid = bucket
        out.view(-1, *out.shape[2:])[index[valid]] = values[valid].to(out.dtype)


def scan_returns(out, final_states, varlen_states, return_final_states, return_varlen_states):
    """mamba_ssm's return convention for mamba_chunk_scan_combined."""
    if return_varlen_states:
        return (out, final_states, varlen_states) if return_final_states else (out, varlen_states)
    return (out, final_states) if return_final_states else out
