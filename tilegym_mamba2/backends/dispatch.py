"""From a scan and a backend name to the backend's entry point, for the public API and the
compositions (split_conv1d_scan.py, distributed/): one lookup of our own registry, or, while
torch.compile traces (that lookup imports modules, which does not trace), straight to autograd's
custom op, which runs the backend's functions at run time (the package imports every backend,
so each has given autograd its functions by then)."""
import torch

from .. import autograd
from ..core.registry import implementation


def chunk_forward_on(backend, x, a, b, c, d, dt, init_state, chunk_size):
    """mamba2_chunk_forward on ``backend``."""
    if torch.compiler.is_compiling():
        return autograd.differentiable_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size, backend)
    return implementation("mamba2_chunk_forward", backend)(x, a, b, c, d, dt, init_state, chunk_size)


def scan_combined_on(backend, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                     dt_softplus, dt_limit, return_final_states, return_varlen_states):
    """mamba_chunk_scan_combined on ``backend``."""
    args = (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
            return_final_states, return_varlen_states)
    if torch.compiler.is_compiling():
        return autograd.differentiable_scan_combined(*args, backend)
    return implementation("mamba2_chunk_scan_combined", backend)(*args)
