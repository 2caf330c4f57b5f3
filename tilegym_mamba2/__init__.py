"""tilegym-mamba2: the Mamba-2 chunked-scan forward pass in cuTile Python, as a TileGym plugin.

Importing this package registers the ops of ``ops_registry.yaml`` with tilegym (when it is
installed), so ``tilegym.ops.mamba2_chunk_forward`` runs our kernels under the "cutile"
backend. The same op is callable directly as ``tilegym_mamba2.mamba2_chunk_forward``.
"""
from .registry import implementation, install
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
    return implementation("mamba2_chunk_forward", backend)(x, a, b, c, d, dt, init_state, chunk_size)


install()

__all__ = ["Mamba2ProblemSpec", "mamba2_chunk_forward", "__version__"]
