"""Experiments 64 and 68 (CPU, no GPU): the chunk-state walk's arithmetic with packed sequences,
written out in float64 torch step by step as chunk_states_walk_kernel runs it (its masks, the
sequence ids at the chunks' edges as experiment 68 takes them), against the pytorch backend's scan forwards and its scan on
token-flipped inputs backwards (backward._flipped_scan). It checks the masks' logic, not the
cuTile code (tests/cutile/test_chunk_states_walk_gpu.py does that on a GPU).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/variants/walk_emulation.py
"""
import math

import torch

from tilegym_mamba2.backward import _flipped_scan, pytorch_kernels

F64 = torch.float64
L = 64


def chunked(t, chunks):
    """[batch, tokens, ...] -> zero-padded to chunks * L tokens."""
    out = t.new_zeros(t.shape[0], chunks * L, *t.shape[2:])
    out[:, :t.shape[1]] = t
    return out


def walk(x, b, dt, log_decay, init, seq_idx, reverse):
    """The kernel's loop for every (batch, head) at once: -> entry states [batch, chunks, heads,
    head, state] in walk order, the final state [batch, heads, head, state]."""
    batch, tokens, heads, _ = x.shape
    chunks = -(-tokens // L)
    g = chunked(log_decay / math.log(2), chunks).view(batch, chunks, L, heads).cumsum(2)  # base 2, per chunk
    xs, ws = chunked(x, chunks).view(batch, chunks, L, heads, -1), chunked(dt, chunks).view(batch, chunks, L, heads)
    bs = chunked(b.repeat_interleave(heads // b.shape[2], 2), chunks).view(batch, chunks, L, heads, -1)
    seq = None if seq_idx is None else chunked(seq_idx, chunks).view(batch, chunks, L)  # padding: 0, as the load
    state = torch.zeros(batch, heads, x.shape[3], b.shape[3], dtype=F64) if init is None else init.clone()
    if init is not None and seq is not None and not reverse:
        state = state * (seq_idx[:, 0] == 0)[:, None, None, None]
    entries = []
    carried = None  # the id the state left the previous step's chunk through (experiment 68)
    for step in range(chunks):
        chunk = chunks - 1 - step if reverse else step
        entries.append(state)
        gc = g[:, chunk]                                                   # [batch, L, heads]
        g_first, g_last = gc[:, :1], gc[:, -1:]
        if reverse:
            next_first = g[:, chunk + 1, :1] if chunk + 1 < chunks else torch.zeros_like(g_first)
            keep = torch.exp2(g_last - g_first + next_first)[:, 0]          # [batch, heads]
            weight = torch.exp2(gc - g_first)
        else:
            keep = torch.exp2(g_last)[:, 0]
            weight = ws[:, chunk] * torch.exp2(g_last - gc)
        if seq is not None:
            # As the kernel takes them since experiment 68: from the chunk's tile (its first id,
            # the largest id among its tokens in the row) and the previous step's.
            in_row = chunk * L + torch.arange(L) < tokens
            first_id = seq[:, chunk, 0]
            last_id = torch.where(in_row, seq[:, chunk], torch.iinfo(torch.int32).min).amax(1)
            if reverse:
                leaving, arriving = first_id, last_id if step == 0 else carried
            else:
                leaving, arriving = last_id, first_id if step == 0 else carried
            carried = leaving
            weight = weight * (seq[:, chunk] == leaving[:, None])[..., None]
            keep = keep * (arriving == leaving)[:, None]
        update = torch.einsum("blh,blhn,blhp->bhpn", weight, bs[:, chunk], xs[:, chunk])
        state = state * keep[..., None, None] + update
    return torch.stack(entries, 1), state


def packed(batch, tokens):
    cuts = torch.tensor(sorted({tokens // 3, tokens // 3 + 1, 64, tokens - 1} - {0}))
    seq = (torch.arange(tokens)[:, None] >= cuts[None, :]).sum(1).to(torch.int32)
    return torch.stack([seq + (row == 1) for row in range(batch)])


def check(batch, tokens, groups, heads, state, head, seed):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)
    x, dy = randn(batch, tokens, heads, head), randn(batch, tokens, heads, head)
    b, c = randn(batch, tokens, groups, state), randn(batch, tokens, groups, state)
    dt = torch.nn.functional.softplus(randn(batch, tokens, heads) - 1)
    log_decay = -torch.rand(heads, generator=g, dtype=F64) * 4 * dt
    init, dfinal = randn(batch, heads, head, state), randn(batch, heads, head, state)
    kernels = pytorch_kernels(F64)
    worst = 0.0
    # Negative ids too: the kernel's largest id must leave the padding (id 0) out.
    for seq_idx in (None, packed(batch, tokens), packed(batch, tokens) - 10):
        got, got_final = walk(x, b, dt, log_decay, init, seq_idx, reverse=False)
        _, want_final, _, (want, _, _) = kernels.scan(x, b, b, dt, log_decay, init, seq_idx, None, outputs=False)
        got_rev, got_first = walk(dy, c, dt, log_decay, dfinal, seq_idx, reverse=True)
        _, want_first, _, (want_rev, _, _) = _flipped_scan(kernels, dy, b, c, log_decay, dfinal, seq_idx, None, False)
        for a, w in ((got, want), (got_final, want_final), (got_rev, want_rev), (got_first, want_first)):
            worst = max(worst, ((a - w).norm() / w.norm()).item())
    return worst


if __name__ == "__main__":
    for case in ((2, 1000, 2, 4, 16, 8), (2, 64, 1, 2, 8, 4), (2, 130, 1, 2, 8, 4), (1, 1, 1, 2, 8, 4),
                 (3, 577, 1, 4, 8, 8)):
        worst = check(*case, seed=0)
        print(case, "worst rel err", f"{worst:.1e}", "ok" if worst < 1e-12 else "DIFFERS")
