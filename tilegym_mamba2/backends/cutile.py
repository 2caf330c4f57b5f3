"""The "cutile" backend: our cuTile kernels as one Backend object, and the registry's targets.

Each runner checks its call (or takes the checks from its launch plan on a repeated call), then
runs the kernels on the current CUDA stream without autograd; the Backend object (base.py)
hands calls that may want a gradient to its differentiable ops, which run the same runners.
The backward runs ssd/backward.py's algorithm over the kernels' scans (KERNELS).
"""
import contextlib
from dataclasses import replace

import torch

from ..core.constants import MAX_STATE
from ..core.packing import scan_returns
from ..core.quarantine import quarantine_layer
from ..core.toolchain import compile_errors_explained
from ..core.validation import (BackwardArgs, ForwardArgs, ScanCombinedArgs, backward_args, check_backward_args,
                               check_forward_args, check_scan_combined_args, forward_args, scan_combined_args,
                               fields, scan_combined_call, values)
from ..runtime import limits, other_token_class, plan
from ..runtime.launch import new_output
from ..ssd import gate_grads, scans
from ..ssd.autograd import keeps_ungated
from ..ssd.backward import Kernels, chunk_backward, layer_backward, scan_combined_backward
from ..ssd.end_state import end_state_differentiable
from ..ssd.forward import run_stages
from ..ssd.layer import layer_config, run_layer
from .base import Backend
from .split_conv1d_scan import split_conv1d_scan

# What the shared backward runs on: the forward's kernels as scans, the reversed walk, chunk_grads, the
# gate's gradients. Their packed calls run quarantined (core/quarantine.py): the kernels mask by
# zero weights.
KERNELS = Kernels(scans.scan, scans.chunk_grads, reversed_scan=scans.reversed_scan, isolates_sequences=False,
                  gate_dy=gate_grads.gate_dy, gate_dz=gate_grads.gate_dz)


def chunk_forward_kernels(call: ForwardArgs):
    """The forward's kernels, without autograd. A repeated call's checks and config come from its
    plan (runtime/plan.py)."""
    if getattr(call.b, "ndim", 0) == 4 and call.b.shape[3] > MAX_STATE:
        return split_state_forward(call)
    key = plan.signature("forward", *values(call))
    config = plan.planned(key)
    if config is None:
        args = check_forward_args(**fields(call), limits=limits.CUTILE)
    else:
        args = forward_args(**fields(call))
    with compile_errors_explained(), _noticed(config, "mamba2_chunk_forward", args.x):
        stages = run_stages(*values(args), config)
    if config is None:
        plan.remember(key, stages.config)
        other_token_class.compile_other_class(lambda args: run_stages(*values(args), stages.config), args.x,
                                              args=args)
    return stages.out, stages.final_state


def _noticed(planned, op, x):
    """A call with a plan compiles nothing; one without may, and says so when it takes a while."""
    return plan.first_call_notice(op, getattr(x, "shape", ())) if planned is None else contextlib.nullcontext()


def _halves(d):
    """state_size 512: every state column evolves on its own, so the op is the sum of two runs on
    the halves of b and c, the skip counted once."""
    return ((slice(None, MAX_STATE), d), (slice(MAX_STATE, None), torch.zeros_like(d)))


def split_state_forward(call: ForwardArgs):
    """Outputs of the two halves summed, their final states side by side. x is read twice."""
    args = check_forward_args(**fields(call), limits=limits.CUTILE)
    outs, finals = [], []
    for half, skip in _halves(args.d):
        init = None if args.init_state is None else args.init_state[..., half]
        out, final = chunk_forward_kernels(replace(args, b=args.b[..., half], c=args.c[..., half], d=skip,
                                                   init_state=init))
        outs.append(out)
        finals.append(final)
    return (outs[0].float() + outs[1].float()).to(args.x.dtype), torch.cat(finals, -1)


def chunk_backward_kernels(call: BackwardArgs):
    """Gradients of mamba2_chunk_forward; ``state_dtype`` of tilegym's call is not part of it: states stay fp32."""
    key = plan.signature("backward", *values(call))
    planned = plan.planned(key)
    args = check_backward_args(**fields(call), limits=limits.CUTILE) if planned is None else backward_args(**fields(call))
    with compile_errors_explained(), _noticed(planned, "mamba2_chunk_backward", args.x):
        if args.b.shape[3] <= MAX_STATE:
            grads = chunk_backward_replay(args)
        else:
            grads = _split_state_backward(args)
    if planned is None and args.b.shape[3] <= MAX_STATE:
        other_token_class.compile_other_class(chunk_backward_replay, args.x, args=args)
    plan.remember(key, True)  # the checks passed; the kernels' configs have plans of their own
    return grads


def chunk_backward_replay(args: BackwardArgs):
    """The plain op's backward on checked arguments (also other_token_class's replay of it)."""
    return chunk_backward(KERNELS, args.x, args.a, args.b, args.c, args.d, args.dt, args.init_state, args.dout,
                          args.dfinal_state)


def _split_state_backward(args: BackwardArgs):
    """state_size 512 in two halves (see split_state_forward): gradients that sum over the state
    (dx, da, ddt) add up, the per-column ones (db, dc, dinit_state) sit side by side."""
    halves = []
    for half, skip in _halves(args.d):
        def part(t):
            return None if t is None else t[..., half].contiguous()
        halves.append(chunk_backward_replay(replace(args, b=part(args.b), c=part(args.c), d=skip,
                                              init_state=part(args.init_state), dfinal_state=part(args.dfinal_state))))
    (dx1, da1, db1, dc1, dd, ddt1, di1), (dx2, da2, db2, dc2, _, ddt2, di2) = halves
    return ((dx1.float() + dx2.float()).to(args.x.dtype), da1 + da2, torch.cat([db1, db2], -1),
            torch.cat([dc1, dc2], -1), dd, (ddt1.float() + ddt2.float()).to(ddt1.dtype), torch.cat([di1, di2], -1))


def scan_combined_kernels(call: ScanCombinedArgs, keep_ungated: bool = False):
    """The layer op's kernels, without autograd -> (its returns, y + D x before the gate where
    ``keep_ungated`` and autograd.keeps_ungated say so, else None: the backward's dz takes it
    instead of running the forward's output kernel again). A repeated call's checks and config
    come from its plan (runtime/plan.py), except with packed sequences, whose offsets are checked every call."""
    signature = plan.signature("layer", *values(call))
    packed = call.seq_idx is not None or call.cu_seqlens is not None
    key = None if packed else signature
    config = plan.planned(key)
    if config is None:
        args = check_scan_combined_args(**fields(call), limits=limits.CUTILE)
    else:
        args = scan_combined_args(**fields(call))
    ungated = new_output(*args.x.shape, dtype=args.x.dtype, device=args.x.device) if keep_ungated and keeps_ungated(
        CUTILE, args.x, args.z, args.initial_states, args.cu_seqlens) else None
    # A packed call is checked every time but compiles only the first time its signature comes.
    seen_key = None if signature is None else ("packed", signature)
    seen = config if not packed else plan.planned(seen_key)
    with compile_errors_explained(), _noticed(seen, "mamba_chunk_scan_combined", args.x):
        if config is None:
            config = layer_config(args)
            plan.remember(key, config)
        if not packed:
            out, final_states, varlen = run_layer(args, config=config, ungated=ungated)
        else:
            out, final_states, varlen = _quarantined_layer(args, config, ungated)
            plan.remember(seen_key, True)
    if seen is None:
        other_token_class.compile_other_class(_layer_replay(config, training=keep_ungated), args.x, args=args,
                                              ungated=ungated)
    return scan_returns(out, final_states, varlen, args.return_final_states, args.return_varlen_states), ungated


def _layer_replay(config, training):
    """The layer op's host code for other_token_class: the forward, and for a call through autograd
    (``training``) the backward autograd will run, on the gradients it will pass."""
    def replay(args, ungated):
        run_layer(args, config=config, ungated=ungated)
        if training:
            batch, _, heads, head_size = args.x.shape
            state = (heads, head_size, args.B.shape[3])
            dfinal_states = args.x.new_zeros(batch, *state, dtype=torch.float32)
            dvarlen_states = (args.x.new_zeros(args.cu_seqlens.shape[0] - 1, *state, dtype=torch.float32)
                              if args.return_varlen_states else None)
            layer_backward(KERNELS, replace(args, return_final_states=True),
                           torch.empty_like(args.x, memory_format=torch.contiguous_format), dfinal_states,
                           dvarlen_states, ungated=ungated)
    return replay


def _quarantined_layer(args, config, ungated=None):
    """run_layer on packed sequences (core/quarantine.py): the kernels keep sequences apart by
    zero weights, so a sequence with a non-finite input runs on zeros there and comes out NaN.
    ``ungated`` stays unpoisoned: the backward's own quarantine poisons that sequence's gradients."""
    quarantine, clean, _ = quarantine_layer(args)
    out, final_states, varlen = run_layer(clean, config=config, ungated=ungated)
    return (quarantine.poison_tokens(out), quarantine.poison_row_lasts(final_states),
            quarantine.poison_sequences(varlen))


def scan_combined_backward_kernels(call: ScanCombinedArgs, dout, dfinal_states, dvarlen_states, *, checked, ungated):
    """Gradients of mamba_chunk_scan_combined on our kernels (ssd/backward.py)."""
    with compile_errors_explained():
        return scan_combined_backward(lambda dtype: KERNELS, call, dout, dfinal_states, dvarlen_states,
                                      limits=limits.CUTILE, checked=checked, ungated=ungated)


CUTILE = Backend(name="cutile", limits=limits.CUTILE, kernels_for=lambda dtype: KERNELS,
                 run_chunk_forward=chunk_forward_kernels, run_chunk_backward=chunk_backward_kernels,
                 run_scan_combined=scan_combined_kernels, run_scan_combined_backward=scan_combined_backward_kernels,
                 end_state=end_state_differentiable)


# --- the registry's targets (tilegym's dispatcher calls them with the public arguments) ----------

def mamba2_chunk_forward(x, a, b, c, d, dt, init_state=None, chunk_size=128):
    """Mamba-2 chunked forward on our cuTile kernels; see ``tilegym_mamba2.mamba2_chunk_forward``."""
    return CUTILE.chunk_forward(x, a, b, c, d, dt, init_state, chunk_size)


def mamba2_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                          state_dtype=torch.float32):
    """See tilegym_mamba2.mamba2_chunk_backward. ``state_dtype`` is accepted for tilegym's call;
    states stay fp32."""
    return CUTILE.chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size)


def mamba_chunk_scan_combined(*args, **kwargs):
    """See ``tilegym_mamba2.mamba_chunk_scan_combined`` (its arguments, without ``backend``)."""
    return CUTILE.scan_combined(scan_combined_call(*args, **kwargs))


def mamba_chunk_scan_combined_backward(dout, dfinal_states, dvarlen_states, *args, **kwargs):
    """Gradients of mamba_chunk_scan_combined on our kernels: the gradients of its outputs, then
    its arguments."""
    return CUTILE.scan_combined_backward(scan_combined_call(*args, **kwargs), dout, dfinal_states, dvarlen_states)


def mamba_split_conv1d_scan_combined(*args, **kwargs):
    """See ``tilegym_mamba2.mamba_split_conv1d_scan_combined``: its scan on this backend."""
    return split_conv1d_scan(*args, **kwargs, backend=CUTILE)
