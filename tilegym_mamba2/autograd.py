"""Autograd and torch.compile for both scans: torch.library custom ops with fake implementations,
and eager torch.autograd.Functions with the same setup and gradients.

The path of a call that may want a gradient (an input that requires grad, grad mode on), or
that torch.compile traces: a backend's entry point (backends/) hands it to
differentiable_chunk_forward / differentiable_scan_combined with its name; the Function (or the
custom op) runs that backend's own functions, forward and backward, which the backend gave here
at import (provide). Nothing here imports a backend or the registry, and no call comes back
through either: the backend's functions run the kernels with autograd off.

Eager calls take the Function: a custom op's dispatch costs host time on every call
(docs/design.md, "Autograd"). Only torch.compile needs the custom ops.

varlen_states are differentiable too (mamba_ssm refuses a backward with them).
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .core.packing import per_sequence_init, scan_returns
from .core.validation import check_scan_flags

_NONE = ()  # custom ops return tensors only: an empty tensor stands for "no gradient"


def wanted(*tensors) -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


# --- the backends' own functions, which the custom ops and the eager Functions run ----------

@dataclass(frozen=True)
class BackendOps:
    """What autograd runs for one backend: functions that check their arguments and run without
    autograd, each with its public counterpart's arguments and returns."""
    chunk_forward: Callable            # mamba2_chunk_forward's -> (out, final_state)
    chunk_backward: Callable           # mamba2_chunk_backward's -> (dx, da, db, dc, dd, ddt, dinit_state)
    scan_combined: Callable            # mamba_chunk_scan_combined's -> its returns
    # mamba2_chunk_scan_combined_backward's -> (dx, ddt, ..., dinitial_states), without the checks:
    # the forward checked the same saved tensors, and autograd refuses a backward after any of
    # them changed in place; keyword ``ungated``: scan_combined_training's, or None.
    scan_combined_backward: Callable
    # scan_combined's call -> (its returns, the output before its gate, y + D x, or None): kept for
    # the backward's dz, which then need not run the forward again for it. It gives the output
    # exactly where keeps_ungated says; None: the backend keeps nothing.
    scan_combined_training: Callable | None = None


_BACKENDS: dict[str, BackendOps] = {}


def provide(backend: str, ops: BackendOps) -> None:
    """Called by each backend module at import."""
    _BACKENDS[backend] = ops


def _ops(backend: str) -> BackendOps:
    try:
        return _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)} for a differentiable scan, "
                         f"got {backend!r}") from None


def _run_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size, backend):
    return _ops(backend).chunk_forward(x, a, b, c, d, dt, init_state, chunk_size)


def _run_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, backend):
    return _ops(backend).chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size)


def _run_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                       dt_low, dt_high, return_varlen_states, backend):
    """-> (out, final_states, varlen_states or an empty tensor, the output before its gate or an
    empty tensor)."""
    ops = _ops(backend)
    call = (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
            (dt_low, dt_high), True, return_varlen_states)
    if ops.scan_combined_training is None:
        result, ungated = ops.scan_combined(*call), None
    else:
        result, ungated = ops.scan_combined_training(*call)
    return (result[0], result[1], result[2] if return_varlen_states else x.new_empty(_NONE),
            x.new_empty(_NONE) if ungated is None else ungated)


def keeps_ungated(backend, x, z, initial_states, cu_seqlens) -> bool:
    """Where a backend's scan_combined_training gives the output before its gate: with z, unless
    packed sequences start from initial states of their own (their terms join the gated output
    after compute_out)."""
    return (_ops(backend).scan_combined_training is not None and z is not None
            and not per_sequence_init(initial_states, cu_seqlens, x.shape[0]))


def _run_scan_combined_backward(dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D, z, dt_bias,
                                initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low, dt_high, ungated, backend):
    return _ops(backend).scan_combined_backward(
        dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
        cu_seqlens, dt_softplus, (dt_low, dt_high), ungated=ungated)


# --- mamba2_chunk_forward ------------------------------------------------------------------

@torch.library.custom_op("tilegym_mamba2::chunk_forward", mutates_args=())
def chunk_forward(x: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, dt: Tensor, init_state: Tensor | None,
                  chunk_size: int, backend: str) -> tuple[Tensor, Tensor]:
    out, final_state = _run_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size, backend)
    # Contiguous, as the fake's outputs are: compiled graphs assume the fake's strides.
    return out.contiguous(), final_state.contiguous()


@chunk_forward.register_fake
def _(x, a, b, c, d, dt, init_state, chunk_size, backend):
    batch, _, heads, head_size = x.shape
    return x.new_empty(x.shape), x.new_empty(batch, heads, head_size, b.shape[3], dtype=_state_dtype(x))


@torch.library.custom_op("tilegym_mamba2::chunk_backward", mutates_args=())
def chunk_backward(x: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, dt: Tensor, init_state: Tensor | None,
                   dout: Tensor, dfinal_state: Tensor, chunk_size: int, backend: str) -> list[Tensor]:
    grads = _run_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, backend)
    # Contiguous, as the fake's outputs are: compiled graphs assume the fake's strides.
    return [g.clone() if _aliases(g, (x, a, b, c, d, dt, init_state, dout, dfinal_state)) else g.contiguous()
            for g in grads]


@chunk_backward.register_fake
def _(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, backend):
    heads, state = x.shape[2], _state_dtype(x)
    return [x.new_empty(x.shape), a.new_empty(heads, dtype=state), b.new_empty(b.shape), c.new_empty(c.shape),
            d.new_empty(heads, dtype=state), dt.new_empty(dt.shape),
            x.new_empty(x.shape[0], heads, x.shape[3], b.shape[3], dtype=state)]


def _chunk_setup(ctx, inputs, output):
    *tensors, ctx.chunk_size, ctx.backend = inputs
    ctx.save_for_backward(*tensors)


def _chunk_grads(ctx, dout, dfinal_state, backward=chunk_backward):
    x, a, b, c, d, dt, init_state = ctx.saved_tensors
    dout, dfinal_state = _zeros_for_unused(x, b, dout, dfinal_state)
    dx, da, db, dc, dd, ddt, dinit = backward(x, a, b, c, d, dt, init_state, dout.contiguous(),
                                              dfinal_state.contiguous(), ctx.chunk_size, ctx.backend)
    return (dx, da.to(a.dtype), db, dc, dd.to(d.dtype), ddt, None if init_state is None else dinit.to(init_state.dtype),
            None, None)


chunk_forward.register_autograd(_chunk_grads, setup_context=_chunk_setup)


# --- mamba_chunk_scan_combined -------------------------------------------------------------

@torch.library.custom_op("tilegym_mamba2::scan_combined", mutates_args=())
def scan_combined(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None,
                  z: Tensor | None, dt_bias: Tensor | None, initial_states: Tensor | None, seq_idx: Tensor | None,
                  cu_seqlens: Tensor | None, dt_softplus: bool, dt_low: float, dt_high: float,
                  return_varlen_states: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in _run_scan_combined(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low, dt_high,
        return_varlen_states, backend))


@scan_combined.register_fake
def _(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low,
      dt_high, return_varlen_states, backend):
    batch, _, heads, head_size = x.shape
    state = (heads, head_size, B.shape[3])
    final_states = x.new_empty(batch, *state, dtype=_state_dtype(x))
    varlen = (C.new_empty(cu_seqlens.shape[0] - 1, *state) if return_varlen_states else x.new_empty(_NONE))
    ungated = (x.new_empty(x.shape) if keeps_ungated(backend, x, z, initial_states, cu_seqlens)
               else x.new_empty(_NONE))
    return x.new_empty(x.shape), final_states, varlen, ungated


@torch.library.custom_op("tilegym_mamba2::scan_combined_backward", mutates_args=())
def scan_combined_backward(dout: Tensor, dfinal_states: Tensor, dvarlen_states: Tensor | None, x: Tensor,
                           dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None,
                           z: Tensor | None, dt_bias: Tensor | None, initial_states: Tensor | None,
                           seq_idx: Tensor | None, cu_seqlens: Tensor | None, dt_softplus: bool, dt_low: float,
                           dt_high: float, ungated: Tensor | None, backend: str) -> list[Tensor]:
    grads = _run_scan_combined_backward(dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D, z,
                                        dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low, dt_high,
                                        ungated, backend)
    inputs = (dout, dfinal_states, dvarlen_states, x, dt, A, B, C, D, z, dt_bias, initial_states)
    return [x.new_empty(_NONE) if g is None else g.clone() if _aliases(g, inputs) else g.contiguous() for g in grads]


@scan_combined_backward.register_fake
def _(dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
      cu_seqlens, dt_softplus, dt_low, dt_high, ungated, backend):
    return [x.new_empty(_NONE) if t is None else t.new_empty(t.shape)
            for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)]


def _layer_setup(ctx, inputs, output):
    (x, dt, A, B, C, ctx.chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ctx.dt_softplus,
     ctx.dt_low, ctx.dt_high, ctx.return_varlen_states, ctx.backend) = inputs
    # The output before its gate, where the backend kept it (one more tensor like x per call, as
    # mamba_ssm keeps): the backward's dz reads it instead of running compute_out again.
    ungated = output[3] if output[3].ndim else None  # _NONE's tensor has no dimensions
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ungated)


def _layer_grads(ctx, dout, dfinal_states, dvarlen_states, dungated=None, backward=scan_combined_backward):
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ungated = ctx.saved_tensors
    dout, dfinal_states = _zeros_for_unused(x, B, dout, dfinal_states)
    # varlen states the loss left out stay None (eager calls): a gradient for them, even of
    # zeros, takes the backward's per-sequence edge terms.
    if not ctx.return_varlen_states:
        dvarlen_states = None
    grads = backward(
        dout.contiguous(), dfinal_states.contiguous(),
        None if dvarlen_states is None else dvarlen_states.contiguous(), x, dt, A, B, C, ctx.chunk_size, D, z,
        dt_bias, initial_states, seq_idx, cu_seqlens, ctx.dt_softplus, ctx.dt_low, ctx.dt_high, ungated, ctx.backend)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = [None if t is None else g.to(t.dtype)
                                                    for g, t in zip(grads, (x, dt, A, B, C, D, z, dt_bias,
                                                                            initial_states))]
    # After chunk_size: D, z, dt_bias, initial_states, then no gradient for the rest.
    return (dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, dinit) + (None,) * 7


scan_combined.register_autograd(_layer_grads, setup_context=_layer_setup)


def _zeros_for_unused(x, B, dout, dfinal_states):
    """The eager Functions leave the gradients of outputs the loss did not use as None; the
    backward takes zeros for the output and the final states."""
    if dout is None:
        dout = torch.zeros_like(x)
    if dfinal_states is None:
        dfinal_states = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3], dtype=_state_dtype(x))
    return dout, dfinal_states


def _state_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _aliases(t, inputs) -> bool:
    # A custom op's outputs may not alias its inputs (a gradient that is an input, e.g. dout).
    return any(i is not None and t.data_ptr() == i.data_ptr() and t.numel() and i.numel() for i in inputs)


# --- eager autograd: the same pieces without the custom ops' dispatch ----------------------

def _eager_function(name, setup, run, grads, run_backward):
    """A torch.autograd.Function with a custom op's setup, forward and gradients."""
    def forward(ctx, *inputs):
        outputs = run(*inputs)  # first: the backend's checks name a bad argument before setup saves it
        setup(ctx, inputs, outputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return outputs

    def backward(ctx, *cotangents):
        return grads(ctx, *cotangents, backward=run_backward)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                    "backward": staticmethod(once_differentiable(backward))})


_EagerChunkForward = _eager_function("_EagerChunkForward", _chunk_setup, _run_chunk_forward, _chunk_grads,
                                     _run_chunk_backward)
_EagerScanCombined = _eager_function("_EagerScanCombined", _layer_setup, _run_scan_combined, _layer_grads,
                                     _run_scan_combined_backward)


# --- what the backends' entry points call --------------------------------------------------

def differentiable_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size, backend):
    # No checks here: the backend's own forward checks its arguments (or takes them from its
    # plan) inside the Function, before anything is saved.
    op = chunk_forward if torch.compiler.is_compiling() else _EagerChunkForward.apply
    return op(x, a, b, c, d, dt, init_state, chunk_size, backend)


def differentiable_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                                 dt_softplus, dt_limit, return_final_states, return_varlen_states, backend):
    op = scan_combined
    if not torch.compiler.is_compiling():
        # float(dt_limit[i]) below must not meet a malformed dt_limit, nor scan_returns a flag that
        # is not a bool; the tensors are checked once, by the backend inside the Function (a
        # packed call's checks read its offsets back from the device: a second check waits twice).
        check_scan_flags(dt_softplus, dt_limit, return_final_states, return_varlen_states)
        op = _EagerScanCombined.apply
    out, final_states, varlen, _ = op(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                      cu_seqlens, dt_softplus, float(dt_limit[0]), float(dt_limit[1]),
                                      return_varlen_states, backend)
    return scan_returns(out, final_states, varlen, return_final_states, return_varlen_states)
