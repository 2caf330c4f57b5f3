"""The "cutile" backend: the registry's targets for our kernels.

Each entry point checks its arguments (or takes them from its launch plan on a repeated call),
then either hands the call to autograd, when a gradient may be wanted, or runs the kernels on
the current CUDA stream. The backward runs backward.py's algorithm over the kernels' scans.
"""
import contextlib

import torch

from ..autograd import (BackendOps, differentiable_chunk_forward, differentiable_scan_combined, keeps_ungated, provide,
                        wanted)
from ..backward import Kernels, chunk_backward, layer_backward, scan_combined_backward
from ..core.packing import scan_returns
from ..core.quarantine import quarantine_layer
from ..core.toolchain import compile_errors_explained
from ..core.validation import (NO_LIMIT, backward_args, check_backward_args, check_forward_args,
                               check_scan_combined_args, forward_args, scan_combined_args)
from ..cutile import gate_grads, other_token_class, plan, scan
from ..cutile.forward import run_stages
from ..cutile.launch import new_output
from ..cutile.scan_combined import layer_config, run_layer

MAX_STATE = 256  # the widest state a kernel carries; wider ones run in halves

# What backward.py runs on: the forward's kernels as scans, the reversed walk, chunk_grads, the
# gate's gradients. Their packed calls run quarantined (core/quarantine.py): the kernels mask by
# zero weights.
KERNELS = Kernels(scan.scan, scan.chunk_grads, reversed_scan=scan.reversed_scan, isolates_sequences=False,
                  gate_dy=gate_grads.gate_dy, gate_dz=gate_grads.gate_dz)


def mamba2_chunk_forward(x, a, b, c, d, dt, init_state=None, chunk_size=128):
    """Mamba-2 chunked forward on our cuTile kernels; see ``tilegym_mamba2.mamba2_chunk_forward``."""
    if wanted(x, a, b, c, d, dt, init_state):
        return differentiable_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size, "cutile")
    return chunk_forward_kernels(x, a, b, c, d, dt, init_state, chunk_size)


def chunk_forward_kernels(x, a, b, c, d, dt, init_state=None, chunk_size=128):
    """The forward's kernels, without autograd. A repeated call's checks and config come from its
    plan (plan.py)."""
    if getattr(b, "ndim", 0) == 4 and b.shape[3] > MAX_STATE:
        return split_state_forward(x, a, b, c, d, dt, init_state, chunk_size)
    key = plan.signature("forward", x, a, b, c, d, dt, init_state, chunk_size)
    config = plan.planned(key)
    if config is None:
        args = check_forward_args(x, a, b, c, d, dt, init_state, chunk_size, backend="cutile")
    else:
        args = forward_args(x, a, b, c, d, dt, init_state, chunk_size)
    with compile_errors_explained(), _noticed(config, "mamba2_chunk_forward", x):
        stages = run_stages(*args, config)
    if config is None:
        plan.remember(key, stages.config)
        other_token_class.compile_other_class(lambda args: run_stages(*args, stages.config), args.x, args=args)
    return stages.out, stages.final_state


def _noticed(planned, op, x):
    """A call with a plan compiles nothing; one without may, and says so when it takes a while."""
    return plan.first_call_notice(op, getattr(x, "shape", ())) if planned is None else contextlib.nullcontext()


def split_state_forward(x, a, b, c, d, dt, init_state, chunk_size):
    """state_size 512: every state column evolves on its own, so the op is the sum of two runs on
    the halves of b and c (outputs) and their final states side by side. x is read twice."""
    x, a, b, c, d, dt, init_state, chunk_size = check_forward_args(x, a, b, c, d, dt, init_state, chunk_size,
                                                                   backend="cutile")
    outs, finals = [], []
    for half, skip in ((slice(None, MAX_STATE), d), (slice(MAX_STATE, None), torch.zeros_like(d))):
        init = None if init_state is None else init_state[..., half]
        out, final = chunk_forward_kernels(x, a, b[..., half], c[..., half], skip, dt, init, chunk_size)
        outs.append(out)
        finals.append(final)
    return (outs[0].float() + outs[1].float()).to(x.dtype), torch.cat(finals, -1)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=NO_LIMIT,
                              return_final_states=False, return_varlen_states=False):
    """See ``tilegym_mamba2.mamba_chunk_scan_combined``."""
    if wanted(x, dt, A, B, C, D, z, dt_bias, initial_states):
        return differentiable_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                            cu_seqlens, dt_softplus, dt_limit, return_final_states,
                                            return_varlen_states, "cutile")
    return scan_combined_kernels(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                                 dt_softplus, dt_limit, return_final_states, return_varlen_states)


def scan_combined_kernels(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                          seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=NO_LIMIT,
                          return_final_states=False, return_varlen_states=False):
    """The layer op's kernels, without autograd. A repeated call's checks and config come from its
    plan (plan.py), except with packed sequences, whose offsets are checked every call."""
    call = (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
            return_final_states, return_varlen_states)
    return _layer_kernels(call, keep_ungated=False)[0]


def scan_combined_training(*call):
    """scan_combined_kernels' call for autograd -> (its returns, y + D x before the gate where
    autograd.keeps_ungated, else None): the backward's dz takes it instead of running the
    forward's output kernel again."""
    return _layer_kernels(call, keep_ungated=True)


def _layer_kernels(call, keep_ungated):
    signature = plan.signature("layer", *call)
    *_, seq_idx, cu_seqlens, _, _, return_final_states, return_varlen_states = call
    packed = seq_idx is not None or cu_seqlens is not None
    key = None if packed else signature
    config = plan.planned(key)
    if config is None:
        args = check_scan_combined_args(*call, backend="cutile")
    else:
        args = scan_combined_args(*call)
    ungated = new_output(*args.x.shape, dtype=args.x.dtype, device=args.x.device) if keep_ungated and keeps_ungated(
        "cutile", args.x, args.z, args.initial_states, args.cu_seqlens) else None
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
    return scan_returns(out, final_states, varlen, return_final_states, return_varlen_states), ungated


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
            layer_backward(KERNELS, args._replace(return_final_states=True),
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


def mamba2_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                          state_dtype=torch.float32):
    """See tilegym_mamba2.mamba2_chunk_backward. ``state_dtype`` is accepted for tilegym's call;
    states stay fp32."""
    call = (x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size)
    key = plan.signature("backward", *call)
    planned = plan.planned(key)
    args = check_backward_args(*call, backend="cutile") if planned is None else backward_args(*call)
    x, a, b, c, d, dt, init_state, dout, dfinal_state, _ = args
    with compile_errors_explained(), _noticed(planned, "mamba2_chunk_backward", x):
        if b.shape[3] <= MAX_STATE:
            grads = chunk_backward(KERNELS, x, a, b, c, d, dt, init_state, dout, dfinal_state)
        else:
            grads = _split_state_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state)
    if planned is None and b.shape[3] <= MAX_STATE:
        other_token_class.compile_other_class(lambda args: chunk_backward(KERNELS, *args[:-1]), x, args=args)
    plan.remember(key, True)  # the checks passed; the kernels' configs have plans of their own
    return grads


def _split_state_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state):
    """state_size 512 in two halves (see split_state_forward): gradients that sum over the state
    (dx, da, ddt) add up, the per-column ones (db, dc, dinit_state) sit side by side."""
    halves = []
    for half, skip in ((slice(None, MAX_STATE), d), (slice(MAX_STATE, None), torch.zeros_like(d))):
        def part(t):
            return None if t is None else t[..., half].contiguous()
        halves.append(chunk_backward(KERNELS, x, a, part(b), part(c), skip, dt, part(init_state), dout,
                                     part(dfinal_state)))
    (dx1, da1, db1, dc1, dd, ddt1, di1), (dx2, da2, db2, dc2, _, ddt2, di2) = halves
    return ((dx1.float() + dx2.float()).to(x.dtype), da1 + da2, torch.cat([db1, db2], -1), torch.cat([dc1, dc2], -1),
            dd, (ddt1.float() + ddt2.float()).to(ddt1.dtype), torch.cat([di1, di2], -1))


def mamba_chunk_scan_combined_backward(dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D=None, z=None,
                                       dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None,
                                       dt_softplus=False, dt_limit=NO_LIMIT):
    """Gradients of mamba_chunk_scan_combined on our kernels (backward.scan_combined_backward)."""
    with compile_errors_explained():
        return scan_combined_backward(lambda dtype: KERNELS, dout, dfinal_states, dvarlen_states, x, dt, A, B, C,
                                      chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                                      dt_limit, backend="cutile")


def _checked_scan_combined_backward(*args, ungated=None):
    """Autograd's backward of the layer op: the forward checked these arguments."""
    with compile_errors_explained():
        return scan_combined_backward(lambda dtype: KERNELS, *args, backend="cutile", checked=True, ungated=ungated)


provide("cutile", BackendOps(chunk_forward_kernels, mamba2_chunk_backward, scan_combined_kernels,
                             _checked_scan_combined_backward, scan_combined_training))
