"""tilegym-mamba2: the Mamba-2 chunked-scan forward pass in cuTile Python, as a TileGym plugin.

Importing this package registers the ops of ``ops_registry.yaml`` with tilegym (when it is
installed), so ``tilegym.ops.mamba2_chunk_forward`` runs our kernels under the "cutile"
backend. The same op is callable directly as ``tilegym_mamba2.mamba2_chunk_forward``.
"""
import torch

from .autograd import differentiable_chunk_forward, differentiable_scan_combined
from .registry import implementation, install, preferred_backend
from .testing import Mamba2ProblemSpec

__version__ = "0.1.0"


def mamba2_chunk_forward(x, a, b, c, d, dt, init_state=None, chunk_size=128, *, backend="cutile"):
    """Mamba-2 chunked forward pass.

    Per head: h_t = exp(a dt_t) h_{t-1} + dt_t x_t b_t^T,  y_t = h_t c_t + d x_t.

    Args:
        x: [batch, tokens, heads, head_size], bfloat16, float16 or float32.
        a: [heads] fp32, negative.   d: [heads] fp32, the skip connection.
        b, c: [batch, tokens, groups, state_size] in x's dtype; heads % groups == 0.
        dt: [batch, tokens, heads], positive (already through softplus).
        init_state: [batch, heads, head_size, state_size] fp32, or None for zeros.
        chunk_size: 16, 32, 64, 128 or 256. Any number of tokens >= 1.
        backend: "cutile" (our kernels, CUDA tensors) or "pytorch" (reference, any device).

    Returns:
        out [batch, tokens, heads, head_size] in x's dtype,
        final_state [batch, heads, head_size, state_size] fp32.
    """
    if torch.compiler.is_compiling():  # straight to the custom op: the registry is not traceable
        return differentiable_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size, backend)
    return implementation("mamba2_chunk_forward", backend)(x, a, b, c, d, dt, init_state, chunk_size)


def mamba2_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                          state_dtype=None, *, backend="cutile"):
    """Gradients of ``mamba2_chunk_forward`` (tilegym's call and return contract).

    Args: the forward's arguments, plus dout [batch, tokens, heads, head_size] (the gradient
    of out) and dfinal_state [batch, heads, head_size, state_size] (of final_state; None: zero).
    state_dtype is accepted for tilegym's call; states stay fp32.

    Returns (dx, da, db, dc, dd, ddt, dinit_state): dx like x; da, dd [heads] fp32; db, dc
    [batch, tokens, groups, state_size] (summed over each group's heads) in x's dtype; ddt like
    dt; dinit_state [batch, heads, head_size, state_size] fp32 (zeros when init_state is None).
    For training, calling mamba2_chunk_forward on tensors that require grad is simpler: it is
    differentiable and runs this on backward.
    """
    return implementation("mamba2_chunk_backward", backend)(x, a, b, c, d, dt, init_state, dout, dfinal_state,
                                                            chunk_size)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, *, backend=None):
    """Drop-in for mamba_ssm's ``mamba_chunk_scan_combined`` (forward): what a Mamba-2 mixer calls.

    Args (mamba_ssm's names):
        x: [batch, tokens, heads, head_size];  dt: [batch, tokens, heads], raw.
        A: [heads] (negative);  B, C: [batch, tokens, groups, state_size].
        chunk_size: 16..256, a power of two.
        D: [heads] or [heads, head_size], the skip;  z: like x, gates the output: y * silu(z).
        dt_bias: [heads];  dt_softplus;  dt_limit: (low, high):
            dt = clamp(softplus?(dt + dt_bias), low, high).
        initial_states: [batch, heads, head_size, state_size] (each row's first sequence), or
            with cu_seqlens [num_sequences, heads, head_size, state_size] (one per sequence).
        seq_idx: [batch, tokens] int, each token's sequence, sorted along tokens.
        cu_seqlens: [num_sequences + 1] int start offsets of sequences packed in batch 1
            (defines seq_idx when that is not given).
        return_final_states, return_varlen_states: as in mamba_ssm.
        backend: None (our cuTile kernels for CUDA tensors, the "pytorch" backend for others)
            or a backend name.

    Returns:
        out [batch, tokens, heads, head_size] in x's dtype; then final_states
        [batch, heads, head_size, state_size] fp32 if asked; then varlen_states
        [num_sequences, heads, head_size, state_size] fp32 if asked.
    """
    op = "mamba2_chunk_scan_combined"
    if torch.compiler.is_compiling():
        return differentiable_scan_combined(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
            return_final_states, return_varlen_states, backend or ("cutile" if x.is_cuda else "pytorch"))
    if backend is None:
        backend = preferred_backend(op) if getattr(x, "is_cuda", False) else "pytorch"
    return implementation(op, backend)(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
        return_final_states, return_varlen_states)


install()

__all__ = ["Mamba2ProblemSpec", "mamba2_chunk_backward", "mamba2_chunk_forward", "mamba_chunk_scan_combined", "__version__"]
