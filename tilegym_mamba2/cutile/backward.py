"""The cutile backend of mamba2_chunk_backward: backward.py's four scans on our kernels."""
import torch

from ..backward import chunk_backward
from ..validation import check_backward_args
from . import compile_errors_explained
from .scan import KERNELS


def mamba2_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                          state_dtype=torch.float32):
    """See tilegym_mamba2.mamba2_chunk_backward. ``state_dtype`` is accepted for tilegym's call;
    states stay fp32."""
    args = check_backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, backend="cutile")
    with compile_errors_explained():
        return chunk_backward(KERNELS, *args[:-1])
