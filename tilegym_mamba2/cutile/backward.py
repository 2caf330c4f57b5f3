"""The cutile backend of mamba2_chunk_backward: backward.py's four scans on our kernels."""
import torch

from ..backward import chunk_backward
from ..validation import check_backward_args
from . import MAX_STATE, compile_errors_explained
from .scan import KERNELS


def mamba2_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state=None, chunk_size=128,
                          state_dtype=torch.float32):
    """See tilegym_mamba2.mamba2_chunk_backward. ``state_dtype`` is accepted for tilegym's call;
    states stay fp32."""
    args = check_backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, backend="cutile")
    with compile_errors_explained():
        if b.shape[3] <= MAX_STATE:
            return chunk_backward(KERNELS, *args[:-1])
        return _split_state_backward(*args[:-1])


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
