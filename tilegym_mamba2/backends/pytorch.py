"""The "pytorch" backend: the registry's targets on the PyTorch references, on any device.

Each entry point checks its arguments as the cutile backend does, then hands the call to
autograd when a gradient may be wanted, or runs the reference in float32 (float64 for float64
inputs, so that torch.autograd.gradcheck runs through every op on a CPU).
"""
import functools

import torch
import torch.nn.functional as F

from ..autograd import (BackendOps, differentiable_chunk_forward, differentiable_scan_combined, keeps_ungated, provide,
                        wanted)
from ..backward import Kernels, chunk_backward, input_grad, scan_combined_backward
from ..core.packing import scan_returns
from ..core.serving_validation import (check_conv_args, check_conv_update_args, check_rms_norm_args,
                                       check_state_update_args)
from ..core.tensors import compute_dtype, log_decay
from ..core.validation import NO_LIMIT, check_backward_args, check_forward_args, check_scan_combined_args
from ..reference.layer import process_dt
from ..reference.scan import chunk_grads_reference, scan_reference
from ..reference.serving import (causal_conv1d_reference, causal_conv1d_update_reference, rms_norm_reference,
                                 selective_state_update_reference)
from ..reference.ssd import chunked_forward_reference


def mamba2_chunk_forward_pytorch(x, a, b, c, d, dt, init_state=None, chunk_size=128):
    """The chunked forward in float32, or in float64 when x is float64 -> (out in x's dtype,
    final_state [batch, heads, head_size, state_size] fp32, or fp64 for fp64 x)."""
    if wanted(x, a, b, c, d, dt, init_state):
        return differentiable_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size, "pytorch")
    return chunk_forward_reference(x, a, b, c, d, dt, init_state, chunk_size)


def chunk_forward_reference(x, a, b, c, d, dt, init_state=None, chunk_size=128):
    """The forward without autograd."""
    x, a, b, c, d, dt, init_state, chunk_size = check_forward_args(
        x, a, b, c, d, dt, init_state, chunk_size, backend="pytorch")
    out, final_state = chunked_forward_reference(x, a, b, c, d, dt, init_state, chunk_size=chunk_size,
                                                 dtype=compute_dtype(x))
    return out.to(x.dtype), final_state


def mamba2_chunk_backward_pytorch(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                                  state_dtype=torch.float32):
    """backward.py over the PyTorch scan, in fp32 (fp64 for fp64 inputs). ``state_dtype`` is
    accepted for tilegym's call; states stay fp32."""
    x, a, b, c, d, dt, init_state, dout, dfinal_state, _ = check_backward_args(
        x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, backend="pytorch")
    return chunk_backward(kernels_for(x.dtype), x, a, b, c, d, dt, init_state, dout, dfinal_state)


def mamba_chunk_scan_combined_pytorch(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                      initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                                      dt_limit=(0.0, float("inf")), return_final_states=False,
                                      return_varlen_states=False):
    """The "pytorch" backend: the chunked reference in fp32 (float64 for float64 x), one sequence
    at a time. With a gradient wanted, backward.py's algorithm runs on backward."""
    if wanted(x, dt, A, B, C, D, z, dt_bias, initial_states):
        return differentiable_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                            cu_seqlens, dt_softplus, dt_limit, return_final_states,
                                            return_varlen_states, "pytorch")
    return scan_combined_reference(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                                   dt_softplus, dt_limit, return_final_states, return_varlen_states)


def scan_combined_reference(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                            seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=NO_LIMIT,
                            return_final_states=False, return_varlen_states=False):
    """The layer op without autograd."""
    return _layer_reference((x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                             dt_softplus, dt_limit, return_final_states, return_varlen_states), False)[0]


def scan_combined_training_reference(*call):
    """scan_combined_reference's call for autograd -> (its returns, the output before its gate in
    x's dtype where autograd.keeps_ungated, else None)."""
    return _layer_reference(call, True)


def _layer_reference(call, keep_ungated):
    args = check_scan_combined_args(*call, backend="pytorch")
    x, dt, A, B, C, chunk_size, D, z = args.x, args.dt, args.A, args.B, args.C, args.chunk_size, args.D, args.z
    initial_states, seq_idx, cu_seqlens = args.initial_states, args.seq_idx, args.cu_seqlens
    dtype = compute_dtype(x)
    dt = process_dt(dt, args.dt_bias, args.dt_softplus, args.dt_limit, dtype=dtype)
    out, final_states, varlen = scan_reference(x, B, C, dt, log_decay(A.to(dtype), dt), initial_states, seq_idx,
                                               cu_seqlens, chunk_size=chunk_size, dtype=dtype,
                                               varlen_states=args.return_varlen_states)
    if D is not None:
        out = out + (D[:, None] if D.ndim == 1 else D) * x.to(dtype)
    ungated = None
    if keep_ungated and keeps_ungated("pytorch", x, z, initial_states, cu_seqlens):
        ungated = out.to(x.dtype)
    if z is not None:
        out = out * F.silu(z.to(dtype))
    # mamba_ssm returns the per-sequence states in C's dtype (the final states in fp32).
    varlen_states = varlen.to(C.dtype) if varlen is not None else None
    return scan_returns(out.to(x.dtype), final_states, varlen_states, args.return_final_states,
                        args.return_varlen_states), ungated


def mamba_chunk_scan_combined_backward_pytorch(dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size,
                                               D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                                               cu_seqlens=None, dt_softplus=False, dt_limit=NO_LIMIT):
    """Gradients of mamba_chunk_scan_combined on the PyTorch scan (backward.scan_combined_backward)."""
    return scan_combined_backward(kernels_for, dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D,
                                  z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
                                  backend="pytorch")


def kernels_for(dtype) -> Kernels:
    """The PyTorch scan and chunk_grads_reference in fp32 (fp64 for fp64 inputs)."""
    return pytorch_kernels(torch.promote_types(dtype, torch.float32))


def pytorch_kernels(dtype, chunk_size=64) -> Kernels:
    """The pytorch backend's: scan_reference and chunk_grads_reference in ``dtype``."""
    def chunk_grads(x, b, c, dy, a, seq_idx, forward_states, reverse_states, skip, dy_low=None):
        if dy_low is not None:
            dy = dy.to(dtype) + dy_low.to(dtype)
        entry, weight, log_decay = forward_states
        rev_entry, _, rev_decay = reverse_states
        chunks = entry.shape[1]
        # Chunk k ends where reversed chunk K-1-k starts: dS = exp(its first decay) * its entry state.
        first = rev_decay[:, ::chunk_size][:, :chunks].to(dtype)                     # [batch, chunks, heads]
        ends = (torch.exp(first)[..., None, None] * rev_entry).flip(1)
        dxs, ddt_input, dl, db, dc = chunk_grads_reference(x, b, c, dy, weight, log_decay, entry, ends, seq_idx,
                                                           chunk_size=chunk_size)
        weight = weight.to(dtype)
        dskip = None
        if skip is not None:
            dskip = (dy.to(dtype) * x.to(dtype)).sum((0, 1))
            dskip = dskip.sum(1, keepdim=True) if skip.shape[1] == 1 else dskip
        return (input_grad(dxs, weight, dy, skip, x.dtype), ddt_input + a * dl, (weight * dl).sum((0, 1)), db, dc,
                dskip)

    scan = functools.partial(scan_reference, dtype=dtype, chunk_size=chunk_size, chunk_states=True)
    return Kernels(scan, chunk_grads, chunk_size)


def selective_state_update_pytorch(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                   state_batch_indices=None):
    """mamba_ssm's selective_state_update: updates ``state`` in place, returns out in x's dtype."""
    return selective_state_update_reference(check_state_update_args(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, backend="pytorch"))


def causal_conv1d_fn_pytorch(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                             final_states_out=None, activation=None):
    """causal_conv1d's causal_conv1d_fn (reference/serving.py says how)."""
    return causal_conv1d_reference(check_conv_args(x, weight, bias, seq_idx, initial_states, return_final_states,
                                                   final_states_out, activation, backend="pytorch"))


def causal_conv1d_update_pytorch(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                                 conv_state_indices=None):
    """causal_conv1d's causal_conv1d_update: ``conv_state`` updated in place."""
    return causal_conv1d_update_reference(check_conv_update_args(
        x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, backend="pytorch"))


def rms_norm_pytorch(x, weight, gate=None, eps=1e-6, group_size=None):
    """Hugging Face's Mamba-2 (gated) RMSNorm (reference/serving.py says how)."""
    return rms_norm_reference(check_rms_norm_args(x, weight, gate, eps, group_size, backend="pytorch"))


def _checked_scan_combined_backward(*args, ungated=None):
    """Autograd's backward of the layer op: the forward checked these arguments."""
    return scan_combined_backward(kernels_for, *args, backend="pytorch", checked=True, ungated=ungated)


provide("pytorch", BackendOps(chunk_forward_reference, mamba2_chunk_backward_pytorch, scan_combined_reference,
                              _checked_scan_combined_backward, scan_combined_training_reference))
