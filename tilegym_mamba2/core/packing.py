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


def scan_returns(out, final_states, varlen_states, return_final_states, return_varlen_states):
    """mamba_ssm's return convention for mamba_chunk_scan_combined."""
    if return_varlen_states:
        return (out, final_states, varlen_states) if return_final_states else (out, varlen_states)
    return (out, final_states) if return_final_states else out
