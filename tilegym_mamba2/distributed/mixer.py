"""context_parallel_split_conv1d_scan_combined: a Mamba-2 mixer's training forward over a
sequence split along tokens: the composition of backends/split_conv1d_scan.py with the
convolution's halo (conv.py) and the scan's state chain (scan.py) in place of their
single-GPU forms. The norm and the projections act token by token and need nothing more.
"""
import torch

from ..backends.split_conv1d_scan import check_mixer_args, split_conv1d_scan
from ..core.registry import backend_of
from ..runtime.limits import PYTORCH as PYTORCH_LIMITS
from ..serving.validation import check_conv_args
from ..core.validation import check_scan_combined_args
from .agreement import agree, check_group_device, edge_ids, fingerprints, group_or_world
from .conv import conv_slice
from .scan import scan_slice

OP = "context_parallel_split_conv1d_scan_combined"


def context_parallel_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                                initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                                return_final_states=False, activation="silu", rmsnorm_weight=None,
                                                rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
                                                headdim=None, ngroups=1, norm_before_gate=True, group=None,
                                                backend=None):
    """mamba_split_conv1d_scan_combined with zxbcdt [batch, slice tokens, channels] this rank's
    slice (seq_idx too); the weights, A, D, dt_bias, initial_states and options the same on every
    rank. Returns this rank's out, then the global final states on every rank if asked.
    Differentiable as context_parallel_scan_combined (weight gradients: this rank's share)."""
    group = group_or_world(group)
    backend = backend_of("mamba2_split_conv1d_scan_combined", backend, zxbcdt)
    width = conv1d_weight.shape[1] if isinstance(conv1d_weight, torch.Tensor) and conv1d_weight.ndim == 2 else 1
    tokens = zxbcdt.shape[1] if isinstance(zxbcdt, torch.Tensor) and zxbcdt.ndim == 3 else 0

    def check():
        check_group_device(group, zxbcdt.device if isinstance(zxbcdt, torch.Tensor) else torch.device("cpu"))
        nheads, hd, dstate, d_nonssm = check_mixer_args(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, headdim,
                                                        ngroups, activation, rmsnorm_weight, outproj_weight,
                                                        outproj_bias, rmsnorm_eps, norm_before_gate)
        batch, dim = zxbcdt.shape[0], nheads * hd
        _, _, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        check_conv_args(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, None, False, None, activation,
                        limits=PYTORCH_LIMITS)
        # The scan's checks, on views of zxbcdt's channels (the convolution keeps their shapes).
        x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        check_scan_combined_args(x.reshape(batch, tokens, nheads, hd), dt, A, B.reshape(batch, tokens, ngroups, dstate),
                                 C.reshape(batch, tokens, ngroups, dstate), chunk_size, D, None, dt_bias,
                                 initial_states, seq_idx, None, True, dt_limit, return_final_states, False,
                                 limits=backend.limits)

    def signature():
        def shape(t):
            return None if t is None else tuple(t.shape)
        return {"zxbcdt's [batch, channels]": (zxbcdt.shape[0], zxbcdt.shape[2]), "zxbcdt's dtype": str(zxbcdt.dtype),
                "conv1d_weight's shape": shape(conv1d_weight), "conv1d_bias's shape": shape(conv1d_bias),
                "D's shape": shape(D), "chunk_size": chunk_size, "initial_states' shape": shape(initial_states),
                "seq_idx (given or not)": seq_idx is not None, "dt_limit": tuple(float(v) for v in dt_limit),
                "return_final_states": return_final_states, "activation": activation,
                "rmsnorm_weight's shape": shape(rmsnorm_weight), "rmsnorm_eps": rmsnorm_eps,
                "outproj_weight's shape": shape(outproj_weight), "outproj_bias's shape": shape(outproj_bias),
                "headdim": headdim, "ngroups": ngroups, "norm_before_gate": norm_before_gate, "backend": backend.name,
                **fingerprints(conv1d_weight=conv1d_weight, conv1d_bias=conv1d_bias, dt_bias=dt_bias, A=A, D=D,
                               initial_states=initial_states, rmsnorm_weight=rmsnorm_weight,
                               outproj_weight=outproj_weight, outproj_bias=outproj_bias)}

    layout = agree(OP, group, check, signature, tokens, lambda: edge_ids(seq_idx, zxbcdt.shape[0], tokens, width - 1))

    def conv(x, weight, bias, seq_idx, activation):
        return conv_slice(layout, group, x, weight, bias, seq_idx, activation=activation)

    def scan(call):
        return scan_slice(layout, group, backend, call)

    return split_conv1d_scan(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx,
                             dt_limit, return_final_states, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight,
                             outproj_bias, headdim, ngroups, norm_before_gate, backend=backend, conv=conv, scan=scan)
