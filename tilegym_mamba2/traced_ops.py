"""The serving ops as torch.library custom ops: the public functions' traceable form, for torch.compile.

A decode step compiled with ``torch.compile(..., fullgraph=True)`` (mode "reduce-overhead"
captures it in a CUDA graph) must not break its graph at selective_state_update,
causal_conv1d_update, causal_conv1d_fn or rms_norm: their host code (argument checks, launch plans,
cuTile's launch) is not traceable. While torch.compile traces, the public functions call these
ops instead; each declares the buffers it writes in place (``mutates_args``), so the compiled
graph orders the state updates correctly and a captured graph replays them, and each has a
fake implementation that gives its output's shape and dtype without running a kernel.

Eager calls do not come here: a custom op's dispatch costs host time on every call, which a
decode step of microseconds cannot spare (docs/design.md, "Autograd", measured the same for
the scans). The implementation runs the backend's entry point through the registry, which
checks the arguments, so bad arguments raise under torch.compile too.
"""
import torch
from torch import Tensor

from .core.registry import backend_for, implementation


def _backend(op, backend, x):
    return backend_for(op, backend or None, x)


@torch.library.custom_op("tilegym_mamba2::selective_state_update", mutates_args=("state",))
def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Tensor | None, z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
                           state_batch_indices: Tensor | None, backend: str) -> Tensor:
    op = "selective_state_update"
    return implementation(op, _backend(op, backend, x))(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices).contiguous()


@selective_state_update.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("tilegym_mamba2::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                         activation: str | None, cache_seqlens: Tensor | None,
                         conv_state_indices: Tensor | None, backend: str) -> Tensor:
    op = "causal_conv1d_update"
    return implementation(op, _backend(op, backend, x))(
        x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices).contiguous()


@causal_conv1d_update.register_fake
def _(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("tilegym_mamba2::causal_conv1d_fn", mutates_args=("final_states",))
def _causal_conv1d_fn(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None,
                      initial_states: Tensor | None, final_states: Tensor | None, activation: str | None,
                      backend: str) -> Tensor:
    # A custom op may not return one of its inputs: the final states, when asked for, go into a
    # buffer the caller passes (causal_conv1d's final_states_out, or a new one: causal_conv1d_fn).
    op = "causal_conv1d_fn"
    result = implementation(op, _backend(op, backend, x))(
        x, weight, bias, seq_idx, initial_states, final_states is not None, final_states, activation)
    out = result[0] if final_states is not None else result
    # The compiled graph relies on the fake's strides; the cutile kernel writes them already, so
    # only another backend's output is copied.
    laid_out = out.transpose(1, 2).is_contiguous() if _channel_last(x) else out.is_contiguous()
    return out if laid_out else _conv_out(x).copy_(out)


def _channel_last(x):
    return x.stride(1) == 1 and x.shape[2] > 1


def _conv_out(x):
    """The output's layout: channel-last (x's stride 1 along dim, as HF's mixer passes it) or
    contiguous, as the cutile kernel allocates it."""
    batch, dim, tokens = x.shape
    if _channel_last(x):
        return x.new_empty(batch, tokens, dim).transpose(1, 2)
    return x.new_empty(batch, dim, tokens)


@_causal_conv1d_fn.register_fake
def _(x, weight, bias, seq_idx, initial_states, final_states, activation, backend):
    return _conv_out(x)


@torch.library.custom_op("tilegym_mamba2::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, gate: Tensor | None, eps: float, group_size: int | None,
              backend: str) -> Tensor:
    op = "mamba2_rms_norm"
    return implementation(op, _backend(op, backend, x))(x, weight, gate, eps, group_size)


@_rms_norm.register_fake
def _(x, weight, gate, eps, group_size, backend):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


def rms_norm(x, weight, gate, eps, group_size, backend):
    return _rms_norm(x, weight, gate, float(eps), group_size, backend)


def causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation,
                     backend):
    """causal_conv1d_fn's call convention on the custom op: out, or (out, final states)."""
    final = final_states_out
    if return_final_states and final is None:
        final = x.new_empty(x.shape[0], x.shape[1], weight.shape[1] - 1)
    out = _causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, final if return_final_states else None,
                            activation, backend or "")
    return (out, final) if return_final_states else out
