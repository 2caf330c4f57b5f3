"""The backward pass, written once over a scan (ssd/reference/scans.py or ssd/scans.py).

Forward, per row and head: h_t = exp(l_t) h_{t-1} + dt_t x_t b_t^T, y_t = h_t c_t, l_t = a dt_t.
With dh_t the gradient reaching h_t (dh after the last token is dfinal_state):

    dh_t = exp(l_{t+1}) dh_{t+1} + dy_t c_t^T          the same scan, backwards in time
    dx_t = dt_t dh_t b_t            dc_t = h_t^T dy_t            db_t = dt_t dh_t^T x_t

Two scans and one chunk-local step give everything that involves a state:
    1. the forward again                                  -> its chunk entry states (y too, for dz,
                                                             where autograd did not keep y + D x)
    2. backwards: x <- dy, b <- c, weight 1               -> the chunk states of dh
    3. chunk_grads: per chunk, from the state S entering it and the gradient dS of the state
       leaving it, dx (dt_t dh_t b_t + skip dy_t), x_t . dh_t b_t, dc, db and the decay gradient
       dl_u = <dh_u, exp(l_u) h_{u-1}> as sums of products within the chunk
       (reference/chunk_grads.py, chunk_grads_reference, states them; sequence_edge_terms adds what
       sequences that start or end inside a chunk with their own state or state gradient add).
"Backwards" is the scan on token-reversed inputs (padded at the front to whole chunks) with
log decay l'_s = l_{T-s} (the decay between a token and the one after it) and 0 where a
sequence ends, so the gradient of a state enters undecayed and nothing crosses a sequence
boundary. The cutile backend runs ssd/chunk_states_walk.py (the reversed scan too, on
unflipped inputs, for one sequence per row; the state pass with packed sequences) and
ssd/chunk_grads.py; the pytorch backend reference/scans.py's scan_reference and
chunk_grads_reference. Each backend passes its Kernels in (backends/cutile.py, backends/pytorch.py).

Summing per-token terms over the rest of the sequence gives dl too, the same value in exact
arithmetic, but one whose terms cancel: 4-20% off with bf16 outputs on the H200, and off in fp32
where dl is small (docs/design.md, "The decay gradient"). Then
    ddt_t = x_t . (dh_t b_t) + a dl_t,    da = sum dt_t dl_t,    dinit = exp(l_first) dh_first.

A scan is called as scan(x, b, c, weight, log_decay, init, seq_idx, cu_seqlens, outputs=...) and
returns (y or None, final_states, varlen_states or None, chunk states); init is
[batch, ...] or, with cu_seqlens, [num_sequences, ...].
"""
from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from ..core.constants import KERNEL_CHUNK
from ..core.packing import SequenceBuckets, packed_sequences, per_sequence_init, seq_idx_from_cu_seqlens
from ..core.quarantine import quarantine_layer
from ..core.tensors import expand_groups, group_sums, log_decay as decay_log
from ..core.validation import check_scan_combined_args, fields, scan_combined_args
from .dt import process_dt, process_dt_slope
from .reference.gate_grads import gate_dy_reference, gate_dz_reference


def scan_combined_backward(kernels_for, call, dout, dfinal_states, dvarlen_states, *, limits, checked=False,
                           ungated=None):
    """Gradients of mamba_chunk_scan_combined for ``call`` (core/validation.py, ScanCombinedArgs): the
    registry op mamba2_chunk_scan_combined_backward, and what autograd runs, with ``checked``.
    -> (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states), None where the input is None.
    ``kernels_for(dtype)``: the backend's Kernels for inputs of that dtype; ``limits``: its Limits.
    ``checked``: the forward checked these very arguments (autograd's call: its saved tensors
    cannot have changed since), so their checks, which read packed offsets back from the device,
    are not repeated. ``ungated``: the forward's output before its gate, y + D x (with z), where
    autograd kept it (autograd.keeps_ungated), else None: then the forward runs again for it."""
    call = replace(call, return_final_states=True, return_varlen_states=dvarlen_states is not None)
    saved = scan_combined_args(**fields(call)) if checked else check_scan_combined_args(**fields(call), limits=limits)
    kernels = kernels_for(saved.x.dtype)
    if kernels.isolates_sequences or (saved.seq_idx is None and saved.cu_seqlens is None):
        return layer_backward(kernels, saved, dout, dfinal_states, dvarlen_states, ungated=ungated)
    return _quarantined_layer_backward(kernels, saved, dout, dfinal_states, dvarlen_states, ungated)


def _quarantined_layer_backward(kernels, saved, dout, dfinal_states, dvarlen_states, ungated):
    """layer_backward on kernels that keep packed sequences apart by zero weights
    (core/quarantine.py): a sequence with a non-finite input or output gradient gets NaN
    gradients, and no other sequence sees its values (``ungated`` of such a sequence, from the
    forward's own quarantine, reaches only its poisoned dz)."""
    quarantine, clean, grads = quarantine_layer(saved, dout, dfinal_states, dvarlen_states)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = layer_backward(kernels, clean, *grads, ungated=ungated)
    tokens, shared = quarantine.poison_tokens, quarantine.poison_shared
    dinit = (quarantine.poison_sequences(dinit) if quarantine.per_sequence_init
             else quarantine.poison_row_firsts(dinit))
    return (tokens(dx), tokens(ddt), shared(dA), tokens(dB), tokens(dC), shared(dD), tokens(dz), shared(ddt_bias),
            dinit)


class Kernels(NamedTuple):
    """What backward.py runs on: a scan that also gives its chunk entry states, and chunk_grads, which makes the gradients from those of the forward
    and the reversed scan; chunk_size: the chunks of both. reversed_scan, where a backend has one,
    runs the scan of dh without flipping the inputs, for one sequence per row or packed ones:
    (dy, C, forward chunk states, dfinal_states, seq_idx) -> what scan gives on the flipped inputs
    (sequence edges inside chunks with their own states or gradients take the flipped scan)."""
    scan: Callable
    chunk_grads: Callable
    chunk_size: int = KERNEL_CHUNK
    reversed_scan: Callable | None = None
    # False for kernels that apply sequence boundaries as zero weights, where 0 * NaN would let a
    # non-finite value cross: their packed calls run quarantined (core/quarantine.py).
    isolates_sequences: bool = True
    # The output gate's gradients (reference/gate_grads.py states them): (dout, z, dtype) -> (dy, dy_low)
    # and (dout, z, y, x, skip) -> dz.
    gate_dy: Callable = gate_dy_reference
    gate_dz: Callable = gate_dz_reference


def scan_backward(kernels, x, A, B, C, dt, dy, skip=None, *, initial_states=None, seq_idx=None, cu_seqlens=None,
                  dfinal_states=None, dvarlen_states=None, want_y=False, dy_low=None):
    """Gradients of (y, final_states, varlen_states) = scan(x, B, C, dt, A * dt, initial_states, ...).

    dt is the processed dt [batch, tokens, heads]; dy [batch, tokens, heads, head_size] in x's
    dtype; dfinal_states [batch, heads, head_size, state_size], dvarlen_states
    [num_sequences, ...] or None. dy_low (like dy, or None): what rounding dy to x's dtype left
    out, which chunk_grads adds back where dy meets x and the states (the reversed scan takes dy
    alone: there its rounding moved no gradient measurably).
    -> (dx, dB, dC, ddt, dA, dinitial_states or None, dskip or None, y or None): dx = dt_t dh_t b_t
    + skip * dy_t in x's dtype (skip [heads, 1] or [heads, head_size], or None; dskip like it),
    the rest in the accumulation dtype (fp32, or fp64 for fp64 inputs); y (the forward's) when
    ``want_y``."""
    batch, tokens, heads, _ = x.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    scan = kernels.scan
    dt = dt.to(acc)
    log_decay = decay_log(A.to(acc), dt)
    own_inits = per_sequence_init(initial_states, cu_seqlens, batch)
    row_init_as_sequences = no_init = False
    if cu_seqlens is not None and cu_seqlens.numel() - 1 != batch and (
            own_inits or dvarlen_states is not None):
        # Initial states and state gradients at sequence edges inside chunks: both scans take
        # them per sequence, chunk_grads' results get their terms (sequence_edge_terms).
        state = (heads, x.shape[3], B.shape[3])
        sequences = cu_seqlens.numel() - 1
        if not own_inits:
            row_init_as_sequences, no_init = initial_states is not None, initial_states is None
            first = initial_states if initial_states is not None else x.new_zeros(1, *state, dtype=acc)
            initial_states = torch.cat([first.to(acc), first.new_zeros(sequences - 1, *state)])
            own_inits = True
        if dvarlen_states is None:
            dvarlen_states = x.new_zeros(sequences, *state, dtype=acc)
    y, _, _, states = scan(x, B, C, dt, log_decay, initial_states, seq_idx, cu_seqlens, outputs=want_y)

    # 2, states only: chunk_grads makes every gradient from the two scans' chunk states. The
    # outputs' varlen states are dh at each sequence's first token (for per-sequence dinit).
    rev_init = _reverse_init(dfinal_states, dvarlen_states)
    if kernels.reversed_scan is not None and not own_inits:
        rev = kernels.reversed_scan(dy, C, states, rev_init, seq_idx)
    else:
        rev = _flipped_scan(kernels, dy, B, C, log_decay, rev_init, seq_idx, cu_seqlens, own_inits)
    dh_first, dh_starts = rev[1], rev[2]
    dx, ddt, dA, dB, dC, dskip = kernels.chunk_grads(x, B, C, dy, A.to(acc), seq_idx, states, rev[3], skip, dy_low)
    if own_inits:  # ddt and dA are linear in dl
        edges = sequence_edge_terms(x, B, C, dy if dy_low is None else dy.to(acc) + dy_low.to(acc), dt, log_decay,
                                    cu_seqlens, seq_idx, initial_states, rev_init.flip(0))
        dx = torch.addcmul(dx.to(acc), edges.dxs, dt[..., None]).to(x.dtype)
        ddt = ddt + (x.to(acc) * edges.dxs).sum(-1) + A.to(acc) * edges.dl
        dA = dA + (dt * edges.dl).sum((0, 1))
        dB, dC = dB + edges.db, dC + edges.dc

    dinit = None
    if initial_states is not None:
        if own_inits:
            # One state per sequence: the reversed scan's sequence ends are the first tokens.
            starts = cu_seqlens[:-1].long()
            dinit = torch.exp(log_decay[0, starts])[..., None, None] * dh_starts.flip(0).to(acc)
        else:
            dinit = torch.exp(log_decay[:, 0])[..., None, None] * dh_first.to(acc)
            if seq_idx is not None:  # a row's initial state belongs to its sequence 0
                dinit = torch.where((seq_idx[:, 0] == 0)[:, None, None, None], dinit, 0.0)
    if row_init_as_sequences:
        dinit = dinit[:1]
    elif no_init:
        dinit = None
    return dx, dB, dC, ddt, dA, dinit, dskip, (y if want_y else None)


def _flipped_scan(kernels, dy, B, C, log_decay, rev_init, seq_idx, cu_seqlens, outputs):
    """The scan of dh, backwards in time: the scan on token-reversed inputs, padded at the front
    to whole chunks so that reversed chunks are the forward's chunks (padding: no input, no
    decay, no sequence change)."""
    tokens = dy.shape[1]
    pad = -tokens % kernels.chunk_size
    seq_rev = None if seq_idx is None else _reverse(seq_idx[:, -1:] - seq_idx, pad)
    cu_rev = None
    if cu_seqlens is not None:
        cu_rev = tokens + pad - cu_seqlens.flip(0)
        cu_rev[0] = 0
    next_decay = torch.zeros_like(log_decay)
    next_decay[:, :-1] = log_decay[:, 1:]
    if seq_idx is not None:
        next_decay[:, :-1] = torch.where((seq_idx[:, 1:] == seq_idx[:, :-1])[..., None], next_decay[:, :-1], 0.0)
    rev_decay = _reverse(next_decay, pad)
    ones = _reverse(torch.ones_like(log_decay), pad)
    return kernels.scan(_reverse(dy, pad), _reverse(C, pad), _reverse(B, pad), ones, rev_decay, rev_init, seq_rev,
                        cu_rev, outputs=outputs)


def input_grad(dxs, dt, dy, skip, dtype):
    """dx = dt * (dh b) + skip * dy in ``dtype``, rounded once (fewer full-size passes than
    separate products)."""
    scaled = dxs * dt[..., None]
    if skip is None:
        return scaled.to(dtype)
    return torch.addcmul(scaled, dy, skip, out=torch.empty(dxs.shape, dtype=dtype, device=dxs.device))


class EdgeTerms(NamedTuple):
    dl: torch.Tensor    # [1, tokens, heads]
    dxs: torch.Tensor   # [1, tokens, heads, head_size]
    db: torch.Tensor    # [1, tokens, groups, state_size]
    dc: torch.Tensor


def sequence_edge_terms(x, B, C, dy, weight, log_decay, cu_seqlens, seq_idx, starts, ends):
    """What the chunk-local gradients leave out when sequences (batch 1) start from their own
    states I_s and their end states get gradients dE_s: the scans' chunk states hold neither
    (they enter outputs by linearity, ssd/sequence_init.py). With h = h0 + h^I and
    dh = dh0 + dh^E, where h^I_t = exp(g_t - g_{p-1}) I_s and dh^E_t = exp(g_e - g_t) dE_s for t
    in sequence s (p, e: its first and last tokens; g: running sums of log decay), the missing
    parts are dh^E_t b_t of dxs, w_t dh^E_t^T x_t of db, h^I_t^T dy_t of dc, and of
    <dh_u, exp(l_u) h_{u-1}>:

        sum_{t >= u} exp(g_t - g_{p-1}) dy_t . (I_s c_t)        <dh0, h^I>
      + sum_{t < u} exp(g_e - g_t) w_t x_t . (dE_s b_t)          <dh^E, h0>
      + exp(g_e - g_{p-1}) <dE_s, I_s>                           <dh^E, h^I>

    No term is a difference: nothing cancels."""
    acc = log_decay.dtype
    tokens, heads, groups = x.shape[1], x.shape[2], B.shape[2]
    dl = torch.zeros_like(log_decay)
    dxs = torch.zeros(x.shape, dtype=acc, device=x.device)
    db = torch.zeros(*x.shape[:3], B.shape[3], dtype=acc, device=x.device)
    dc = torch.zeros_like(db)
    if x.device.type == "meta":
        return EdgeTerms(dl, dxs, group_sums(db, groups, acc), group_sums(dc, groups, acc))
    # Every sum runs within one sequence (each is a row of its own in a bucket: running sums start
    # at its first token): a NaN or inf of one sequence never enters another's terms, as a
    # difference of row-long sums would. One pass per bucket of lengths, not per sequence.
    rows, firsts, lengths, _ = packed_sequences(None, cu_seqlens, 1, tokens)
    buckets = SequenceBuckets(rows, firsts, lengths, tokens, x.device)
    per_head_b, per_head_c = expand_groups(B, heads), expand_groups(C, heads)
    for bucket in buckets.buckets:
        members = bucket[0]
        gx, gdy, gb, gc = (buckets.gather(t, bucket).to(acc) for t in (x, dy, per_head_b, per_head_c))
        w = buckets.gather(weight, bucket).to(acc)
        g = buckets.gather(log_decay, bucket).to(torch.float64).cumsum(1)  # g_t - g_{p-1}; flat past the end
        into = torch.exp(g).to(acc)                                          # exp(g_t - g_{p-1})
        out_of = torch.exp(g[:, -1:] - g).to(acc)                            # exp(g_e - g_t)
        start, grad = starts[members].to(acc), ends[members].to(acc)
        part_dxs = out_of[..., None] * torch.einsum("rhpn,rthn->rthp", grad, gb)
        buckets.scatter(dxs, bucket, part_dxs)
        buckets.scatter(db, bucket, (w * out_of)[..., None] * torch.einsum("rhpn,rthp->rthn", grad, gx))
        buckets.scatter(dc, bucket, into[..., None] * torch.einsum("rhpn,rthp->rthn", start, gdy))
        received = into * (gdy * torch.einsum("rhpn,rthn->rthp", start, gc)).sum(-1)
        sent = (w * (gx * part_dxs).sum(-1)).to(torch.float64)
        suffix = received.to(torch.float64).flip(1).cumsum(1).flip(1)       # over t >= u
        before = torch.cat([torch.zeros_like(sent[:, :1]), sent.cumsum(1)[:, :-1]], 1)  # over t < u
        constant = torch.exp(g[:, -1]).to(acc) * (grad * start).sum((-1, -2))
        buckets.scatter(dl, bucket, (suffix + before).to(acc) + constant[:, None])
    return EdgeTerms(dl, dxs, group_sums(db, groups, acc), group_sums(dc, groups, acc))


def _reverse(t, pad):
    """[batch, tokens, ...] -> token-reversed, with ``pad`` zero tokens in front."""
    if not pad:
        return t.flip(1)
    out = t.new_zeros(t.shape[0], t.shape[1] + pad, *t.shape[2:])
    out[:, pad:] = t.flip(1)
    return out


def _reverse_init(dfinal_states, dvarlen_states):
    """The reversed scan starts each sequence from the gradient of its end state."""
    if dvarlen_states is None:
        return dfinal_states
    starts = dvarlen_states.flip(0).to(torch.promote_types(dvarlen_states.dtype, torch.float32)).clone()
    if dfinal_states is not None:  # the row's final state is its last sequence's end state
        starts[0] += dfinal_states[0]
    return starts


def layer_backward(kernels, saved, dout, dfinal_states=None, dvarlen_states=None, ungated=None):
    """Gradients of mamba_chunk_scan_combined. ``saved``: its checked arguments
    (core/validation.py, ScanCombinedArgs); ``ungated``: y + D x from the forward, or None.
    -> (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states), each in its input's dtype, None for
    an input that is None."""
    x, dt_raw, A, B, C, D, z, dt_bias = saved.x, saved.dt, saved.A, saved.B, saved.C, saved.D, saved.z, saved.dt_bias
    initial_states, seq_idx, cu_seqlens = saved.initial_states, saved.seq_idx, saved.cu_seqlens
    acc = torch.promote_types(x.dtype, torch.float32)
    if cu_seqlens is not None and seq_idx is None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1])
    dt = process_dt(dt_raw, dt_bias, saved.dt_softplus, saved.dt_limit, dtype=acc)
    skip = None if D is None else (D.to(acc)[:, None] if D.ndim == 1 else D.to(acc))
    # The gated dy is no longer x's dtype: it reaches the scans as two terms in x's dtype.
    dy_high, dy_low = (dout.to(x.dtype), None) if z is None else kernels.gate_dy(dout, z, x.dtype)
    dx, dB, dC, ddt, dA, dinit, dskip, y = scan_backward(
        kernels, x, A, B, C, dt, dy_high, skip, initial_states=initial_states, seq_idx=seq_idx,
        cu_seqlens=cu_seqlens, dfinal_states=dfinal_states, dvarlen_states=dvarlen_states,
        want_y=z is not None and ungated is None, dy_low=dy_low)
    dD = None if D is None else (dskip[:, 0] if D.ndim == 1 else dskip).to(D.dtype)
    if z is None:
        dz = None
    elif ungated is not None:  # D x is in it already
        dz = kernels.gate_dz(dout, z, ungated, x, None)
    else:
        dz = kernels.gate_dz(dout, z, y, x, skip)
    ddt_raw = ddt * process_dt_slope(dt_raw, dt_bias, saved.dt_softplus, saved.dt_limit, dtype=acc)
    ddt_bias = None if dt_bias is None else ddt_raw.sum((0, 1)).to(dt_bias.dtype)
    return (dx, ddt_raw.to(dt_raw.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype), dD, dz, ddt_bias,
            None if dinit is None else dinit.to(initial_states.dtype))


def chunk_backward(kernels, x, a, b, c, d, dt, init_state, dout, dfinal_state):
    """Gradients of mamba2_chunk_forward (checked arguments) -> (dx, da, db, dc, dd, ddt, dinit_state):
    dx, db, dc in x's dtype, ddt in dt's, da, dd and dinit_state in fp32 (fp64 for fp64 inputs);
    dinit_state is zeros when init_state is None."""
    acc = torch.promote_types(x.dtype, torch.float32)
    dx, db, dc, ddt, da, dinit, dskip, _ = scan_backward(kernels, x, a, b, c, dt, dout, d.to(acc)[:, None],
                                                         initial_states=init_state, dfinal_states=dfinal_state)
    dd = dskip[:, 0]
    if dinit is None:
        batch, _, heads, head_size = x.shape
        dinit = torch.zeros(batch, heads, head_size, b.shape[3], dtype=acc, device=x.device)
    return dx, da, db.to(b.dtype), dc.to(c.dtype), dd, ddt.to(dt.dtype), dinit
