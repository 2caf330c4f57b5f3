"""tilegym-mamba2: Mamba-2's chunked scan (forward and backward) and its serving ops in cuTile
Python, as a TileGym plugin.

Importing this package registers the ops of ``ops_registry.yaml`` with tilegym (when it is
installed), so ``tilegym.ops.mamba2_chunk_forward`` and the others run our kernels under the
"cutile" backend. The same ops are callable directly from this package; the two scan ops are
differentiable (autograd, torch.compile).

Every function here takes ``backend=None``: our cuTile kernels for CUDA tensors, the "pytorch"
backend (the references) for others; a name overrides. ``tilegym.ops.<op>`` keeps tilegym's
own rule: the backend set by ``tilegym.set_backend``.
"""
import os
import sys
import warnings

from . import moved

moved.install()  # the earlier releases' import paths (tilegym_mamba2.cutile.*, .reference.*) keep working

TILEGYM_OPTIONAL_BACKEND_WARNINGS = ("Triton backend import failed", "TileCpp backend is not available")

__version__ = "0.1.0"


def mamba2_chunk_forward(x, a, b, c, d, dt, init_state=None, chunk_size=128, *, backend=None):
    """Mamba-2 chunked forward pass.

    Per head: h_t = exp(a dt_t) h_{t-1} + dt_t x_t b_t^T,  y_t = h_t c_t + d x_t.

    Args:
        x: [batch, tokens, heads, head_size], bfloat16, float16 or float32 (pytorch: also float64).
        a: [heads] fp32, negative.   d: [heads] fp32, the skip connection.
        b, c: [batch, tokens, groups, state_size] in x's dtype; heads % groups == 0.
        dt: [batch, tokens, heads], positive (already through softplus).
        init_state: [batch, heads, head_size, state_size] fp32, or None for zeros.
        chunk_size: 16, 32, 64, 128 or 256. Any number of tokens >= 1.
        backend: None (our cuTile kernels for CUDA tensors, "pytorch" for others) or a backend name.

    Returns:
        out [batch, tokens, heads, head_size] in x's dtype,
        final_state [batch, heads, head_size, state_size] fp32.
        Differentiable in every tensor input (mamba2_chunk_backward runs on backward).
    """
    return backend_of("mamba2_chunk_forward", backend, x).chunk_forward(x, a, b, c, d, dt, init_state, chunk_size)


def mamba2_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                          state_dtype=None, *, backend=None):
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
    return backend_of("mamba2_chunk_backward", backend, x).chunk_backward(x, a, b, c, d, dt, init_state, dout,
                                                                          dfinal_state, chunk_size)


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
    return backend_of("mamba2_chunk_scan_combined", backend, x).scan_combined(scan_combined_call(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
        return_final_states, return_varlen_states))


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, *, backend=None):
    """Drop-in for mamba_ssm's ``selective_state_update``: one decode step, ``state`` updated in place.

    Args (mamba_ssm's names; the forms without heads drop the heads dimension, as in mamba_ssm):
        state: [slots, heads, head_size, state_size] (or [slots, dim, state_size]); fp32 typical.
        x: [batch, heads, head_size];  dt: like x, raw (may be expanded with stride 0 along head_size).
        A: [heads, head_size, state_size] (may be expanded with stride 0 from [heads]).
        B, C: [batch, groups, state_size], heads % groups == 0.
        D, dt_bias: [heads, head_size] or None;  z: like x or None;  dt_softplus: bool.
        state_batch_indices: [batch] int or None: row i updates state[state_batch_indices[i]];
            a negative index is a padding row (out 0, no state written). Indices must be below
            state.shape[0] and distinct (not checked: that would read the device).
        backend: None (our cuTile kernel for CUDA tensors, "pytorch" for others) or a backend name.

    dt = softplus?(dt + dt_bias); state = exp(A dt) state + dt x B^T; out = state C + D x; out *= silu(z).
    Returns out like x, in x's dtype.
    """
    if torch.compiler.is_compiling():  # traced as one op, the state declared written (custom_ops.py)
        return custom_ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                  state_batch_indices, backend or "")
    op = "selective_state_update"
    return implementation(op, _backend(op, backend, x))(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, *, backend=None):
    """Drop-in for causal_conv1d's ``causal_conv1d_fn`` (forward): depthwise causal convolution.

    Args:
        x: [batch, dim, seqlen], any strides (channel-last, x.stride(1) == 1, as HF's Mamba-2 passes it).
        weight: [dim, width], width 2, 3 or 4;  bias: [dim] or None.
        seq_idx: [batch, seqlen] int or None: packed sequences; no input crosses a boundary, and
            tokens with a negative id are padding (out 0). Excludes initial_states and final states.
        initial_states: [batch, dim, width - 1] or None (zeros): the inputs before the first token.
        return_final_states: also return the last width - 1 inputs [batch, dim, width - 1],
            written into final_states_out when given.
        activation: None, "silu" or "swish".
        backend: None (cuTile for CUDA tensors, "pytorch" for others) or a backend name.

    out[t] = act(bias + sum_w weight[:, w] x[t - (width - 1) + w]). Returns out like x (x's dtype),
    then the final states if asked.
    """
    if torch.compiler.is_compiling():
        return custom_ops.causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, return_final_states,
                                            final_states_out, activation, backend)
    op = "causal_conv1d_fn"
    return implementation(op, _backend(op, backend, x))(
        x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, *, backend=None):
    """Drop-in for causal_conv1d's ``causal_conv1d_update``: the convolution's decode step.

    Args:
        x: [batch, dim] or [batch, dim, seqlen].
        conv_state: [slots, dim, state_len], state_len >= width - 1, updated in place: it becomes
            the last state_len entries of (conv_state, x); with cache_seqlens it is a circular
            buffer and x is written from position cache_seqlens % state_len on.
        weight: [dim, width], width 2..4;  bias: [dim] or None;  activation: None, "silu", "swish".
        cache_seqlens: [batch] int or None.
        conv_state_indices: [batch] int or None: row i uses conv_state[conv_state_indices[i]];
            a negative index is a padding row (out 0, no state written). Indices must be below
            conv_state.shape[0] and distinct (not checked: that would read the device).
        backend: None (cuTile for CUDA tensors, "pytorch" for others) or a backend name.

    Returns out like x, in x's dtype.
    """
    if torch.compiler.is_compiling():
        return custom_ops.causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens,
                                                conv_state_indices, backend or "")
    op = "causal_conv1d_update"
    return implementation(op, _backend(op, backend, x))(
        x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)


def rms_norm(x, weight, gate=None, eps=1e-6, group_size=None, *, backend=None):
    """Hugging Face's Mamba-2 RMSNorm (``gate`` None: Mamba2RMSNorm) and gated RMSNorm
    (MambaRMSNormGated), in one kernel.

    Args:
        x: [..., width];  weight: [width];  gate: like x or None.
        eps: added to the mean square;  group_size: normalise each group of this many values of
            the last dimension on its own (None: the whole width).
        backend: None (cuTile for CUDA tensors, "pytorch" for others) or a backend name.

    h = x * silu(gate); h = h / sqrt(mean(h^2) + eps) (fp32); out = weight * h rounded to x's
    dtype (the rounding is the HF modules'). Returns out like x, in torch's promotion of weight's
    and x's dtypes. Not differentiable: a patched model uses it outside autograd only.
    """
    if torch.compiler.is_compiling():
        return custom_ops.rms_norm(x, weight, gate, eps, group_size, backend or "")
    op = "mamba2_rms_norm"
    return implementation(op, _backend(op, backend, x))(x, weight, gate, eps, group_size)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, *, backend=None):
    """Drop-in for mamba_ssm's ``mamba_split_conv1d_scan_combined``: a Mamba-2 mixer's training
    forward from its input projection's output (z, xBC, dt side by side) through the causal
    convolution, the scan, the gated RMSNorm (groups of dim / ngroups) and the output projection,
    differentiable (backends/split_conv1d_scan.py says how it is composed; the scan is ours).

    Args (mamba_ssm's names): zxbcdt [batch, seqlen, 2 * dim + 2 * ngroups * dstate + nheads] (plus
    2 * d_nonssm MLP channels in front); conv1d_weight [dim + 2 * ngroups * dstate, width];
    conv1d_bias; dt_bias, A [nheads]; D [nheads] (with headdim) or [nheads, headdim]; chunk_size;
    initial_states [batch, nheads, headdim, dstate]; seq_idx [batch, seqlen]; dt_limit;
    return_final_states; activation None/"silu"/"swish"; rmsnorm_weight [dim] or None;
    rmsnorm_eps; outproj_weight [out_dim, dim + d_nonssm], outproj_bias; ngroups;
    norm_before_gate. backend: None (cuTile for CUDA tensors, "pytorch" for others) or a name.

    Returns out [batch, seqlen, out_dim], then final_states fp32 if asked.
    """
    return split_conv1d_scan(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx, dt_limit,
        return_final_states, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups,
        norm_before_gate, backend=backend_of("mamba2_split_conv1d_scan_combined", backend, zxbcdt))



def _running_our_command() -> bool:
    """`python [options] -m tilegym_mamba2 ...` or the tilegym-mamba2 script (this package's own commands)."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if os.path.basename(sys.argv[0] or "") == "tilegym-mamba2":
        return True
    k = 1
    while k < len(argv) and argv[k].startswith("-") and argv[k] != "-m":
        k += 2 if argv[k] in ("-X", "-W") else 1  # an interpreter option, and its value
    return argv[k:k + 2] in (["-m", "tilegym_mamba2"], ["-m", "tilegym_mamba2.__main__"])


_loaded = False


def load() -> None:
    """Imports the backends and installs the registry with tilegym: what importing this package
    does. Only this package's own command line defers it (it parses its arguments first, so that
    --help and usage errors need none of torch, tilegym, transformers or cuda.tile)."""
    global _loaded, torch, custom_ops, _backend, backend_of, implementation, scan_combined_call, split_conv1d_scan
    global Mamba2ProblemSpec
    if _loaded:
        return
    _loaded = True
    import torch
    from .backends.split_conv1d_scan import split_conv1d_scan
    from .core.registry import backend_for as _backend, backend_of, implementation, install, prepare
    from .core.validation import scan_combined_call
    from . import traced_ops as custom_ops  # registers the serving ops for torch.compile
    from .testing import Mamba2ProblemSpec

    # tilegym warns at import about its optional backends (Triton, TileCpp); our commands use
    # neither, so they stay out of our commands' output. A library user sees them as tilegym emits them.
    with warnings.catch_warnings():
        if _running_our_command():
            for message in TILEGYM_OPTIONAL_BACKEND_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
        install()

    # Every backend object resolved now, so that a first call under torch.compile finds it in a
    # plain dict. After install(): tilegym's import brings cuda.tile in the order its packaging
    # expects (imported first by our kernels, it was not found in pytest-xdist workers on the GPU machine).
    prepare()


_DEFERRED = ("custom_ops", "_backend", "backend_of", "implementation", "scan_combined_call", "split_conv1d_scan",
             "Mamba2ProblemSpec")

if _running_our_command():
    def __getattr__(name):
        if name in _DEFERRED:
            load()
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    load()

__all__ = ["Mamba2ProblemSpec", "mamba2_chunk_backward", "mamba2_chunk_forward", "mamba_chunk_scan_combined",
           "mamba_split_conv1d_scan_combined", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update",
           "rms_norm",
           "__version__"]
