"""Autograd and torch.compile for Mamba-2's two scans, built per backend from a description.

``differentiable(backend)`` makes, for one backend object (backends/base.py), an eager
torch.autograd.Function and a torch.library custom op (with its fake and its autograd) for each
op described below. Both close over that backend's own runners (forward and backward without
autograd): nothing here looks a backend up, and no call comes back through the registry.

An op's description says what its Function saves and how its gradients come back; the eager
Function and the custom op share those pieces. Eager calls take the Function: a custom op's
dispatch costs host time on every call (docs/design.md, "Autograd"). Only torch.compile needs
the custom ops.

varlen_states are differentiable too (mamba_ssm refuses a backward with them).
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..core.packing import per_sequence_init, scan_returns
from ..core.validation import BackwardArgs, ForwardArgs, ScanCombinedArgs, check_scan_flags

_NONE = ()  # custom ops return tensors only: an empty tensor stands for "no gradient"


def wanted(*tensors) -> bool:
    """Whether a call may want a gradient: an input requires grad with grad mode on, or
    torch.compile traces (the custom op then stands in the graph, its autograd included)."""
    if torch.compiler.is_compiling():
        return True
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(generator): no Python frame per tensor on every call
            if getattr(t, "requires_grad", False):
                return True
    return False


def keeps_ungated(backend, x, z, initial_states, cu_seqlens) -> bool:
    """Where a backend's forward for autograd gives the output before its gate: with z, unless
    packed sequences start from initial states of their own (their terms join the gated output
    after compute_out)."""
    return backend.keeps_ungated and z is not None and not per_sequence_init(initial_states, cu_seqlens, x.shape[0])


@dataclass(frozen=True)
class OpDescription:
    """One differentiable op: how its Function runs, saves and gives gradients. ``run(backend,
    *inputs)`` and ``run_backward(backend, *saved_and_cotangents)`` call the backend's runners;
    ``setup(ctx, inputs, outputs)`` saves; ``grads(ctx, *cotangents, backward=...)`` returns the
    inputs' gradients through ``backward``, the op's backward custom op or its eager runner."""
    name: str
    run: Callable
    fake: Callable
    setup: Callable
    grads: Callable
    run_backward: Callable
    fake_backward: Callable


@dataclass(frozen=True)
class Differentiable:
    """A backend's differentiable scans: ``chunk_forward`` / ``scan_combined`` take the public
    call's arguments by keyword and return its results."""
    eager: dict      # op name -> torch.autograd.Function
    compiled: dict   # op name -> custom op

    def apply(self, op: str, *inputs):
        fn = self.compiled[op] if torch.compiler.is_compiling() else self.eager[op].apply
        return fn(*inputs)


# --- mamba2_chunk_forward ------------------------------------------------------------------

def _run_chunk_forward(backend, x, a, b, c, d, dt, init_state, chunk_size):
    return backend.run_chunk_forward(ForwardArgs(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=init_state,
                                                 chunk_size=chunk_size))


def _fake_chunk_forward(x, a, b, c, d, dt, init_state, chunk_size):
    batch, _, heads, head_size = x.shape
    return x.new_empty(x.shape), x.new_empty(batch, heads, head_size, b.shape[3], dtype=_state_dtype(x))


def _run_chunk_backward(backend, x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size):
    return backend.run_chunk_backward(BackwardArgs(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=init_state,
                                                   chunk_size=chunk_size, dout=dout, dfinal_state=dfinal_state))


def _fake_chunk_backward(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size):
    heads, state = x.shape[2], _state_dtype(x)
    return [x.new_empty(x.shape), a.new_empty(heads, dtype=state), b.new_empty(b.shape), c.new_empty(c.shape),
            d.new_empty(heads, dtype=state), dt.new_empty(dt.shape),
            x.new_empty(x.shape[0], heads, x.shape[3], b.shape[3], dtype=state)]


def _chunk_setup(ctx, inputs, output):
    *tensors, ctx.chunk_size = inputs
    ctx.save_for_backward(*tensors)


def _chunk_grads(ctx, dout, dfinal_state, *, backward):
    x, a, b, c, d, dt, init_state = ctx.saved_tensors
    dout, dfinal_state = _zeros_for_unused(x, b, dout, dfinal_state)
    dx, da, db, dc, dd, ddt, dinit = backward(x, a, b, c, d, dt, init_state, dout.contiguous(),
                                              dfinal_state.contiguous(), ctx.chunk_size)
    return (dx, da.to(a.dtype), db, dc, dd.to(d.dtype), ddt, None if init_state is None else dinit.to(init_state.dtype),
            None)


CHUNK_FORWARD = OpDescription("chunk_forward", _run_chunk_forward, _fake_chunk_forward, _chunk_setup, _chunk_grads,
                              _run_chunk_backward, _fake_chunk_backward)


# --- mamba_chunk_scan_combined -------------------------------------------------------------

def _run_scan_combined(backend, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                       dt_softplus, dt_low, dt_high, return_varlen_states):
    """-> (out, final_states, varlen_states or an empty tensor, the output before its gate or an
    empty tensor)."""
    call = ScanCombinedArgs(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                            initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                            dt_softplus=dt_softplus, dt_limit=(dt_low, dt_high), return_final_states=True,
                            return_varlen_states=return_varlen_states)
    result, ungated = backend.run_scan_combined(call, keep_ungated=True)
    return (result[0], result[1], result[2] if return_varlen_states else x.new_empty(_NONE),
            x.new_empty(_NONE) if ungated is None else ungated)


def _fake_scan_combined(backend):
    def fake(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low,
             dt_high, return_varlen_states):
        batch, _, heads, head_size = x.shape
        state = (heads, head_size, B.shape[3])
        final_states = x.new_empty(batch, *state, dtype=_state_dtype(x))
        varlen = (C.new_empty(cu_seqlens.shape[0] - 1, *state) if return_varlen_states else x.new_empty(_NONE))
        ungated = (x.new_empty(x.shape) if keeps_ungated(backend, x, z, initial_states, cu_seqlens)
                   else x.new_empty(_NONE))
        return x.new_empty(x.shape), final_states, varlen, ungated
    return fake


def _run_scan_combined_backward(backend, dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D, z,
                                dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low, dt_high, ungated):
    # The forward checked these very tensors (autograd refuses a backward after any of them
    # changed in place): their checks, which read packed offsets back from the device, are not repeated.
    saved = ScanCombinedArgs(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                             initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                             dt_softplus=dt_softplus, dt_limit=(dt_low, dt_high), return_final_states=True,
                             return_varlen_states=dvarlen_states is not None)
    return backend.run_scan_combined_backward(saved, dout, dfinal_states, dvarlen_states, checked=True,
                                              ungated=ungated)


def _fake_scan_combined_backward(dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size, D, z, dt_bias,
                                 initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low, dt_high, ungated):
    return [x.new_empty(_NONE) if t is None else t.new_empty(t.shape)
            for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)]


def _layer_setup(ctx, inputs, output):
    (x, dt, A, B, C, ctx.chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ctx.dt_softplus,
     ctx.dt_low, ctx.dt_high, ctx.return_varlen_states) = inputs
    # The output before its gate, where the backend kept it (one more tensor like x per call, as
    # mamba_ssm keeps): the backward's dz reads it instead of running compute_out again.
    ungated = output[3] if output[3].ndim else None  # _NONE's tensor has no dimensions
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ungated)


def _layer_grads(ctx, dout, dfinal_states, dvarlen_states, dungated=None, *, backward):
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, ungated = ctx.saved_tensors
    dout, dfinal_states = _zeros_for_unused(x, B, dout, dfinal_states)
    # varlen states the loss left out stay None (eager calls): a gradient for them, even of
    # zeros, takes the backward's per-sequence edge terms.
    if not ctx.return_varlen_states:
        dvarlen_states = None
    grads = backward(
        dout.contiguous(), dfinal_states.contiguous(),
        None if dvarlen_states is None else dvarlen_states.contiguous(), x, dt, A, B, C, ctx.chunk_size, D, z,
        dt_bias, initial_states, seq_idx, cu_seqlens, ctx.dt_softplus, ctx.dt_low, ctx.dt_high, ungated)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = [None if t is None else g.to(t.dtype)
                                                    for g, t in zip(grads, (x, dt, A, B, C, D, z, dt_bias,
                                                                            initial_states))]
    # After chunk_size: D, z, dt_bias, initial_states, then no gradient for the rest.
    return (dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, dinit) + (None,) * 6


SCAN_COMBINED = OpDescription("scan_combined", _run_scan_combined, _fake_scan_combined, _layer_setup, _layer_grads,
                              _run_scan_combined_backward, _fake_scan_combined_backward)


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


def _owned(grads, inputs):
    """Custom op outputs: contiguous, as the fake's are (compiled graphs assume the fake's
    strides), never an input, and empty for "no gradient"."""
    return [inputs[0].new_empty(_NONE) if g is None else g.clone() if _aliases(g, inputs) else g.contiguous()
            for g in grads]


# --- building them -------------------------------------------------------------------------

def _eager_function(description, backend):
    """A torch.autograd.Function with the description's setup, forward and gradients."""
    def forward(ctx, *inputs):
        outputs = description.run(backend, *inputs)  # first: the checks name a bad argument before setup saves it
        description.setup(ctx, inputs, outputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return outputs

    def backward(ctx, *cotangents):
        return description.grads(ctx, *cotangents, backward=lambda *a: description.run_backward(backend, *a))

    name = f"{description.name.title().replace('_', '')}{backend.name.title()}"
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                    "backward": staticmethod(once_differentiable(backward))})


def _chunk_custom_ops(backend):
    prefix = f"tilegym_mamba2::{backend.name}_"

    @torch.library.custom_op(prefix + "chunk_forward", mutates_args=())
    def forward(x: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, dt: Tensor, init_state: Tensor | None,
                chunk_size: int) -> tuple[Tensor, Tensor]:
        out, final_state = _run_chunk_forward(backend, x, a, b, c, d, dt, init_state, chunk_size)
        return out.contiguous(), final_state.contiguous()

    @torch.library.custom_op(prefix + "chunk_backward", mutates_args=())
    def backward(x: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, dt: Tensor, init_state: Tensor | None,
                 dout: Tensor, dfinal_state: Tensor, chunk_size: int) -> list[Tensor]:
        grads = _run_chunk_backward(backend, x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size)
        return _owned(grads, (x, a, b, c, d, dt, init_state, dout, dfinal_state))

    forward.register_fake(_fake_chunk_forward)
    backward.register_fake(_fake_chunk_backward)
    forward.register_autograd(lambda ctx, *g: _chunk_grads(ctx, *g, backward=backward), setup_context=_chunk_setup)
    return forward


def _layer_custom_ops(backend):
    prefix = f"tilegym_mamba2::{backend.name}_"

    @torch.library.custom_op(prefix + "scan_combined", mutates_args=())
    def forward(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None,
                z: Tensor | None, dt_bias: Tensor | None, initial_states: Tensor | None, seq_idx: Tensor | None,
                cu_seqlens: Tensor | None, dt_softplus: bool, dt_low: float, dt_high: float,
                return_varlen_states: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return tuple(t.contiguous() for t in _run_scan_combined(
            backend, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
            dt_low, dt_high, return_varlen_states))

    @torch.library.custom_op(prefix + "scan_combined_backward", mutates_args=())
    def backward(dout: Tensor, dfinal_states: Tensor, dvarlen_states: Tensor | None, x: Tensor, dt: Tensor,
                 A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None, z: Tensor | None,
                 dt_bias: Tensor | None, initial_states: Tensor | None, seq_idx: Tensor | None,
                 cu_seqlens: Tensor | None, dt_softplus: bool, dt_low: float, dt_high: float,
                 ungated: Tensor | None) -> list[Tensor]:
        grads = _run_scan_combined_backward(backend, dout, dfinal_states, dvarlen_states, x, dt, A, B, C, chunk_size,
                                            D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_low,
                                            dt_high, ungated)
        return _owned(grads, (x, dout, dfinal_states, dvarlen_states, dt, A, B, C, D, z, dt_bias, initial_states))

    forward.register_fake(_fake_scan_combined(backend))
    backward.register_fake(_fake_scan_combined_backward)
    forward.register_autograd(lambda ctx, *g: _layer_grads(ctx, *g, backward=backward), setup_context=_layer_setup)
    return forward


def differentiable(backend) -> Differentiable:
    """The backend's differentiable scans (called once per backend object)."""
    return Differentiable(
        eager={d.name: _eager_function(d, backend) for d in (CHUNK_FORWARD, SCAN_COMBINED)},
        compiled={"chunk_forward": _chunk_custom_ops(backend), "scan_combined": _layer_custom_ops(backend)})


def differentiable_chunk_forward(ops: Differentiable, call: ForwardArgs):
    # No checks here: the backend's own forward checks its arguments (or takes them from its
    # plan) inside the Function, before anything is saved.
    return ops.apply("chunk_forward", call.x, call.a, call.b, call.c, call.d, call.dt, call.init_state,
                     call.chunk_size)


def differentiable_scan_combined(ops: Differentiable, call: ScanCombinedArgs):
    if not torch.compiler.is_compiling():
        # float(dt_limit[i]) below must not meet a malformed dt_limit, nor scan_returns a flag that
        # is not a bool; the tensors are checked once, by the backend inside the Function (a
        # packed call's checks read its offsets back from the device: a second check waits twice).
        check_scan_flags(call.dt_softplus, call.dt_limit, call.return_final_states, call.return_varlen_states)
    out, final_states, varlen, _ = ops.apply(
        "scan_combined", call.x, call.dt, call.A, call.B, call.C, call.chunk_size, call.D, call.z, call.dt_bias,
        call.initial_states, call.seq_idx, call.cu_seqlens, call.dt_softplus, float(call.dt_limit[0]),
        float(call.dt_limit[1]), call.return_varlen_states)
    return scan_returns(out, final_states, varlen, call.return_final_states, call.return_varlen_states)
