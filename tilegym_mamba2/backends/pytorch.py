"""The "pytorch" backend: the PyTorch references as one Backend object, and the registry's targets,
on any device.

Each runner checks its call as the cutile backend's do, then runs the reference in float32
(float64 for float64 inputs, so that torch.autograd.gradcheck runs through every op on a CPU);
the Backend object (base.py) hands calls that may want a gradient to its differentiable ops.
"""
import functools

import torch
import torch.nn.functional as F

from ..core.constants import KERNEL_CHUNK
from ..core.packing import scan_returns
from ..core.tensors import compute_dtype, log_decay
from ..core.validation import (BackwardArgs, ForwardArgs, ScanCombinedArgs, check_backward_args, check_forward_args,
                               check_scan_combined_args, fields, scan_combined_call, values)
from ..runtime import limits
from ..serving.reference import (causal_conv1d_reference, causal_conv1d_update_reference, rms_norm_reference,
                                 selective_state_update_reference)
from ..serving.validation import check_conv_args, check_conv_update_args, check_rms_norm_args, check_state_update_args
from ..ssd.autograd import keeps_ungated
from ..ssd.backward import Kernels, chunk_backward, input_grad, scan_combined_backward
from ..ssd.reference.end_state import end_state_reference
from ..ssd.reference.forward import chunked_forward_reference
from ..ssd.dt import process_dt
from ..ssd.reference.chunk_grads import chunk_grads_reference
from ..ssd.reference.scans import scan_reference
from .base import Backend
from .split_conv1d_scan import split_conv1d_scan


def chunk_forward_reference(call: ForwardArgs):
    """The chunked forward in float32, or in float64 when x is float64, without autograd ->
    (out in x's dtype, final_state [batch, heads, head_size, state_size] fp32, or fp64 for fp64 x)."""
    args = check_forward_args(**fields(call), limits=limits.PYTORCH)
    out, final_state = chunked_forward_reference(*values(args)[:7], chunk_size=args.chunk_size,
                                                 dtype=compute_dtype(args.x))
    return out.to(args.x.dtype), final_state


def chunk_backward_reference(call: BackwardArgs):
    """The shared backward over the PyTorch scan, in fp32 (fp64 for fp64 inputs)."""
    args = check_backward_args(**fields(call), limits=limits.PYTORCH)
    return chunk_backward(kernels_for(args.x.dtype), args.x, args.a, args.b, args.c, args.d, args.dt,
                          args.init_state, args.dout, args.dfinal_state)


def scan_combined_reference(call: ScanCombinedArgs, keep_ungated: bool = False):
    """The layer op without autograd: the chunked reference in fp32 (float64 for float64 x) ->
    (its returns, the output before its gate in x's dtype where ``keep_ungated`` and
    autograd.keeps_ungated say so, else None)."""
    args = check_scan_combined_args(**fields(call), limits=limits.PYTORCH)
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
    if keep_ungated and keeps_ungated(PYTORCH, x, z, initial_states, cu_seqlens):
        ungated = out.to(x.dtype)
    if z is not None:
        out = out * F.silu(z.to(dtype))
    # mamba_ssm returns the per-sequence states in C's dtype (the final states in fp32).
    varlen_states = varlen.to(C.dtype) if varlen is not None else None
    return scan_returns(out.to(x.dtype), final_states, varlen_states, args.return_final_states,
                        args.return_varlen_states), ungated


def scan_combined_backward_reference(call: ScanCombinedArgs, dout, dfinal_states, dvarlen_states, *, checked,
                                     ungated):
    """Gradients of mamba_chunk_scan_combined on the PyTorch scan (ssd/backward.py)."""
    return scan_combined_backward(kernels_for, call, dout, dfinal_states, dvarlen_states, limits=limits.PYTORCH,
                                  checked=checked, ungated=ungated)


def kernels_for(dtype) -> Kernels:
    """The PyTorch scan and chunk_grads_reference in fp32 (fp64 for fp64 inputs)."""
    return pytorch_kernels(torch.promote_types(dtype, torch.float32))


def pytorch_kernels(dtype, chunk_size=KERNEL_CHUNK) -> Kernels:
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


PYTORCH = Backend(name="pytorch", limits=limits.PYTORCH, kernels_for=kernels_for,
                  run_chunk_forward=chunk_forward_reference, run_chunk_backward=chunk_backward_reference,
                  run_scan_combined=scan_combined_reference, run_scan_combined_backward=scan_combined_backward_reference,
                  end_state=end_state_reference)


# --- the registry's targets (tilegym's dispatcher calls them with the public arguments) ----------

def mamba2_chunk_forward_pytorch(x, a, b, c, d, dt, init_state=None, chunk_size=128):
    """See ``tilegym_mamba2.mamba2_chunk_forward``: the chunked reference, any device."""
    return PYTORCH.chunk_forward(x, a, b, c, d, dt, init_state, chunk_size)


def mamba2_chunk_backward_pytorch(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                                  state_dtype=torch.float32):
    """See ``tilegym_mamba2.mamba2_chunk_backward``. ``state_dtype`` is accepted for tilegym's
    call; states stay fp32."""
    return PYTORCH.chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size)


def mamba_chunk_scan_combined_pytorch(*args, **kwargs):
    """See ``tilegym_mamba2.mamba_chunk_scan_combined`` (its arguments, without ``backend``)."""
    return PYTORCH.scan_combined(scan_combined_call(*args, **kwargs))


def mamba_chunk_scan_combined_backward_pytorch(dout, dfinal_states, dvarlen_states, *args, **kwargs):
    """Gradients of mamba_chunk_scan_combined on the PyTorch scan."""
    return PYTORCH.scan_combined_backward(scan_combined_call(*args, **kwargs), dout, dfinal_states, dvarlen_states)


def selective_state_update_pytorch(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                   state_batch_indices=None):
    """mamba_ssm's selective_state_update: updates ``state`` in place, returns out in x's dtype."""
    return selective_state_update_reference(check_state_update_args(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, limits=limits.PYTORCH))


def causal_conv1d_fn_pytorch(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                             final_states_out=None, activation=None):
    """causal_conv1d's causal_conv1d_fn (serving/reference.py says how)."""
    return causal_conv1d_reference(check_conv_args(x, weight, bias, seq_idx, initial_states, return_final_states,
                                                   final_states_out, activation, limits=limits.PYTORCH))


def causal_conv1d_update_pytorch(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                                 conv_state_indices=None):
    """causal_conv1d's causal_conv1d_update: ``conv_state`` updated in place."""
    return causal_conv1d_update_reference(check_conv_update_args(
        x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, limits=limits.PYTORCH))


def rms_norm_pytorch(x, weight, gate=None, eps=1e-6, group_size=None):
    """Hugging Face's Mamba-2 (gated) RMSNorm (serving/reference.py says how)."""
    return rms_norm_reference(check_rms_norm_args(x, weight, gate, eps, group_size, limits=limits.PYTORCH))


def mamba_split_conv1d_scan_combined_pytorch(*args, **kwargs):
    """See ``tilegym_mamba2.mamba_split_conv1d_scan_combined``: its scan on this backend."""
    return split_conv1d_scan(*args, **kwargs, backend=PYTORCH)
