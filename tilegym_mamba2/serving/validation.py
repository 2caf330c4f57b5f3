"""Argument checks of the serving (decode-step) ops, shared by every backend.

selective_state_update is mamba_ssm's; causal_conv1d_fn and causal_conv1d_update are
causal_conv1d's. Errors name the argument and say what was expected. Nothing here reads a
tensor's values (no device synchronisation, so a decode step can be captured in a CUDA graph),
and nothing is written: a caller's state is untouched when a check fails.

The checks return views (never copies) in one normal form, so each backend sees one layout.
"""
from typing import NamedTuple

import torch

from ..core.validation import (Limits, expect_shape, expect_tensor, check_one_device, check_values,
                               value_checks_enabled)

INDEX_DTYPES = (torch.int32, torch.int64)
CONV_WIDTHS = (2, 3, 4)
ACTIVATIONS = (None, "silu", "swish")


class StateUpdateArgs(NamedTuple):
    """selective_state_update's arguments in the per-head form (views of the caller's tensors)."""
    state: torch.Tensor                 # [slots, heads, head_size, state_size]
    x: torch.Tensor                     # [batch, heads, head_size]
    dt: torch.Tensor                    # [batch, heads, head_size]
    A: torch.Tensor                     # [heads, head_size, state_size]
    B: torch.Tensor                     # [batch, groups, state_size]
    C: torch.Tensor                     # [batch, groups, state_size]
    D: torch.Tensor | None              # [heads, head_size]
    z: torch.Tensor | None              # [batch, heads, head_size]
    dt_bias: torch.Tensor | None        # [heads, head_size]
    dt_softplus: bool
    state_batch_indices: torch.Tensor | None  # [batch] int
    has_heads: bool                     # False: the caller used the 3-D form; squeeze the output


def check_state_update_args(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                            state_batch_indices=None, *, limits: Limits) -> StateUpdateArgs:
    """mamba_ssm's selective_state_update contract. Every tensor may be in the per-head form
    (state [slots, heads, head_size, state_size], ...) or the form without heads (state
    [slots, dim, state_size], x [batch, dim], A [dim, state_size], B, C [batch, state_size],
    D, dt_bias [dim]), each argument on its own, as mamba_ssm accepts them."""
    dtypes = limits.input_dtypes
    named = {"state": state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias}
    for name, t in named.items():
        if t is not None or name in ("state", "x", "dt", "A", "B", "C"):  # the rest are optional
            expect_tensor(name, t)
            expect_dtype(name, t, dtypes, limits.name)
    if state.ndim not in (3, 4):
        raise ValueError(f"state must be [slots, heads, head_size, state_size] or [slots, dim, state_size], "
                         f"got shape {tuple(state.shape)}")
    given = {name: tuple(t.shape) for name, t in named.items() if t is not None}
    args = state_update_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    state, x, dt, A, B, C = args.state, args.x, args.dt, args.A, args.B, args.C
    D, z, dt_bias = args.D, args.z, args.dt_bias

    def expect(name, t, shape, layout):  # the caller's own shape in the message, not the lifted one
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name} must be {layout} = {tuple(shape)}"
                             + (" (the form without heads only goes with state [slots, dim, state_size])"
                                if len(given[name]) != t.ndim else "") + f", got {given[name]}")

    slots, heads, head_size, state_size = state.shape
    if x.ndim != 3:
        raise ValueError(f"x must be [batch, heads, head_size] or [batch, dim], got shape {tuple(x.shape)}")
    batch = x.shape[0]
    expect("x", x, (batch, heads, head_size), "[batch, heads, head_size] with state's heads and head_size")
    if min(batch, heads, head_size, state_size) < 1:
        raise ValueError(f"state and x must have no empty dimension, got state {tuple(state.shape)}, "
                         f"x {tuple(x.shape)}")
    expect("dt", dt, x.shape, "[batch, heads, head_size], the shape of x")
    expect("A", A, (heads, head_size, state_size), "[heads, head_size, state_size] (state's)")
    if B.ndim != 3:
        raise ValueError(f"B must be [batch, groups, state_size] or [batch, state_size], got shape {tuple(B.shape)}")
    groups = B.shape[1]
    expect("B", B, (batch, groups, state_size), "[batch, groups, state_size] (x's batch, state's state_size)")
    if groups < 1 or heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups}), the second dimension of B")
    expect("C", C, B.shape, "[batch, groups, state_size], the shape of B")
    if D is not None:
        expect("D", D, (heads, head_size), "[heads, head_size] (state's)")
    if z is not None:
        expect("z", z, x.shape, "[batch, heads, head_size], the shape of x")
    if dt_bias is not None:
        expect("dt_bias", dt_bias, (heads, head_size), "[heads, head_size] (state's)")
    expect_bool("dt_softplus", dt_softplus)
    expect_writable("state", state)
    if state_batch_indices is None:
        if slots != batch:
            raise ValueError(f"state must have x's batch ({batch}) as its first dimension without "
                             f"state_batch_indices, got {slots}")
    else:
        expect_indices("state_batch_indices", state_batch_indices, batch)
    check_one_device({**named, "state_batch_indices": state_batch_indices}, limits)
    values = {}
    if state_batch_indices is not None and (_on_host(state_batch_indices, limits) or value_checks_enabled()):
        values.update(_slot_checks("state_batch_indices", state_batch_indices, "state", slots))
    if value_checks_enabled():
        values["A must be negative (the decay exp(A dt) below 1), got a value >= 0"] = A < 0
        if not dt_softplus:
            raw = dt if dt_bias is None else dt + dt_bias
            values["dt (plus dt_bias) must be >= 0 without dt_softplus"] = raw >= 0
    check_values(values)
    if limits.serving_max_state is not None and state_size > limits.serving_max_state:
        raise ValueError(f"state_size (last dimension of state) must be at most {limits.serving_max_state} for the "
                         f"{limits.name} backend, got {state_size}; the pytorch backend takes any size")
    return args


def state_update_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices) -> StateUpdateArgs:
    """check_state_update_args' result without its checks, for arguments already known to pass
    them (runtime/plan.py): each argument of the form without heads lifted to the per-head form,
    one head."""
    return StateUpdateArgs(_lift(state, 3, 1), _lift(x, 2, 1), _lift(dt, 2, 1), _lift(A, 2, 0), _lift(B, 2, 1),
                           _lift(C, 2, 1), _lift(D, 1, 0), _lift(z, 2, 1), _lift(dt_bias, 1, 0), dt_softplus,
                           state_batch_indices, state.ndim == 4)


class ConvArgs(NamedTuple):
    x: torch.Tensor                     # [batch, dim, tokens]
    weight: torch.Tensor                # [dim, width]
    bias: torch.Tensor | None           # [dim]
    seq_idx: torch.Tensor | None        # [batch, tokens] int
    initial_states: torch.Tensor | None  # [batch, dim, width - 1]
    return_final_states: bool
    final_states_out: torch.Tensor | None  # [batch, dim, width - 1], only with return_final_states
    silu: bool


def check_conv_args(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                    final_states_out=None, activation=None, *, limits: Limits) -> ConvArgs:
    """causal_conv1d's causal_conv1d_fn contract. x may have any strides (channel-last included).
    As in causal_conv1d, final_states_out is used only with return_final_states, and seq_idx
    excludes initial_states and final states."""
    dtypes = limits.input_dtypes
    expect_tensor("x", x)
    if x.ndim != 3:
        raise ValueError(f"x must be [batch, dim, seqlen], got shape {tuple(x.shape)}")
    batch, dim, tokens = x.shape
    if min(batch, dim, tokens) < 1:
        raise ValueError(f"x [batch, dim, seqlen] must have no empty dimension, got {tuple(x.shape)}")
    width = _check_weight_bias(weight, bias, dim, dtypes, limits.name)
    expect_dtype("x", x, dtypes, limits.name)
    silu = _check_activation(activation)
    expect_bool("return_final_states", return_final_states)
    if seq_idx is not None:
        expect_tensor("seq_idx", seq_idx)
        if seq_idx.dtype not in INDEX_DTYPES:
            raise TypeError(f"seq_idx must be an int32 or int64 tensor, got {seq_idx.dtype}")
        expect_shape("seq_idx", seq_idx, (batch, tokens), "[batch, seqlen] (x's batch and seqlen)")
        if initial_states is not None:
            raise ValueError("initial_states must be None when seq_idx is given (as in causal_conv1d)")
        if return_final_states:
            raise ValueError("return_final_states must be False when seq_idx is given (as in causal_conv1d)")
    if initial_states is not None:
        expect_tensor("initial_states", initial_states)
        expect_shape("initial_states", initial_states, (batch, dim, width - 1), "[batch, dim, width - 1]")
        expect_dtype("initial_states", initial_states, dtypes, limits.name)
    if not return_final_states:
        final_states_out = None
    elif final_states_out is not None:
        expect_tensor("final_states_out", final_states_out)
        expect_shape("final_states_out", final_states_out, (batch, dim, width - 1), "[batch, dim, width - 1]")
        expect_dtype("final_states_out", final_states_out, dtypes, limits.name)
        expect_writable("final_states_out", final_states_out)
    check_one_device({"x": x, "weight": weight, "bias": bias, "seq_idx": seq_idx, "initial_states": initial_states,
                    "final_states_out": final_states_out}, limits)
    return ConvArgs(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, silu)


class ConvUpdateArgs(NamedTuple):
    x: torch.Tensor                     # [batch, dim, tokens]
    conv_state: torch.Tensor            # [slots, dim, state_len]
    weight: torch.Tensor                # [dim, width]
    bias: torch.Tensor | None           # [dim]
    silu: bool
    cache_seqlens: torch.Tensor | None  # [batch] int
    conv_state_indices: torch.Tensor | None  # [batch] int
    squeeze: bool                       # x was [batch, dim]: so is the output


def check_conv_update_args(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                           conv_state_indices=None, *, limits: Limits) -> ConvUpdateArgs:
    """causal_conv1d's causal_conv1d_update contract."""
    dtypes = limits.input_dtypes
    expect_tensor("x", x)
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be [batch, dim] or [batch, dim, seqlen], got shape {tuple(x.shape)}")
    batch, dim, tokens = (*x.shape, 1) if x.ndim == 2 else x.shape
    if min(batch, dim, tokens) < 1:
        raise ValueError(f"x must have no empty dimension, got {tuple(x.shape)}")
    expect_dtype("x", x, dtypes, limits.name)
    expect_tensor("conv_state", conv_state)
    if conv_state.ndim != 3 or conv_state.shape[1] != dim:
        raise ValueError(f"conv_state must be [slots, dim, state_len] with x's dim {dim}, got shape "
                         f"{tuple(conv_state.shape)}")
    expect_dtype("conv_state", conv_state, dtypes, limits.name)
    width = _check_weight_bias(weight, bias, dim, dtypes, limits.name)
    state_len = conv_state.shape[2]
    if state_len < width - 1:
        raise ValueError(f"conv_state's state_len (last dimension) must be at least width - 1 = {width - 1} "
                         f"(weight's width {width}), got {state_len}")
    expect_writable("conv_state", conv_state)
    _check_activation(activation)
    if cache_seqlens is not None:
        expect_indices("cache_seqlens", cache_seqlens, batch)
    if conv_state_indices is None:
        if conv_state.shape[0] != batch:
            raise ValueError(f"conv_state must have x's batch ({batch}) as its first dimension without "
                             f"conv_state_indices, got {conv_state.shape[0]}")
    else:
        expect_indices("conv_state_indices", conv_state_indices, batch)
    check_one_device({"x": x, "conv_state": conv_state, "weight": weight, "bias": bias, "cache_seqlens": cache_seqlens,
                    "conv_state_indices": conv_state_indices}, limits)
    if conv_state_indices is not None and (_on_host(conv_state_indices, limits) or value_checks_enabled()):
        check_values(_slot_checks("conv_state_indices", conv_state_indices, "conv_state", conv_state.shape[0]))
    return conv_update_args(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)


def conv_update_args(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices) -> ConvUpdateArgs:
    """check_conv_update_args' result without its checks, for arguments already known to pass
    them (runtime/plan.py): x [batch, dim] as [batch, dim, 1]."""
    squeeze = x.ndim == 2
    return ConvUpdateArgs(x.unsqueeze(-1) if squeeze else x, conv_state, weight, bias, activation is not None,
                          cache_seqlens, conv_state_indices, squeeze)


class RmsNormArgs(NamedTuple):
    """rms_norm's arguments as rows of one group each (views where the caller's strides allow)."""
    x: torch.Tensor                 # [rows, group_size], stride 1 along the row
    gate: torch.Tensor | None       # like x
    weight: torch.Tensor            # [groups, group_size]
    eps: float
    out_dtype: torch.dtype          # torch's promotion of weight's and x's dtypes
    shape: tuple                    # x's shape, the output's


def check_rms_norm_args(x, weight, gate=None, eps=1e-6, group_size=None, *, limits: Limits) -> RmsNormArgs:
    """Hugging Face's Mamba-2 RMSNorm (gate None) and gated RMSNorm: x [..., width], weight
    [width], gate like x, eps > 0, group_size dividing width (None: the whole width)."""
    dtypes = limits.input_dtypes
    for name, t in (("x", x), ("weight", weight), ("gate", gate)):
        if t is not None or name != "gate":
            expect_tensor(name, t)
            expect_dtype(name, t, dtypes, limits.name)
    if x.ndim < 1 or x.numel() == 0:
        raise ValueError(f"x must be [..., width] with at least one element, got shape {tuple(x.shape)}")
    width = x.shape[-1]
    expect_shape("weight", weight, (width,), "[width] (x's last dimension)")
    if gate is not None:
        expect_shape("gate", gate, tuple(x.shape), "x's shape")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size < 1 or width % group_size):
        raise ValueError(f"group_size must be a positive divisor of x's width {width} (or None), got {group_size!r}")
    check_one_device({"x": x, "weight": weight, "gate": gate}, limits)
    return rms_norm_args(x, weight, gate, eps, group_size)


def rms_norm_args(x, weight, gate, eps, group_size) -> RmsNormArgs:
    """check_rms_norm_args' result without its checks (runtime/plan.py)."""
    size = x.shape[-1] if group_size is None else group_size
    return RmsNormArgs(_rows(x, size), None if gate is None else _rows(gate, size), weight.reshape(-1, size),
                       float(eps), torch.promote_types(weight.dtype, x.dtype), tuple(x.shape))


def _rows(t, size):
    rows = t.reshape(-1, size)
    return rows if rows.stride(1) == 1 else rows.contiguous()


# ---------------------------------------------------------------- helpers

def _lift(t, rank_without_heads, axis):
    return t.unsqueeze(axis) if t is not None and t.ndim == rank_without_heads else t


def expect_dtype(name, t, dtypes, backend: str):
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be one of {names} for the {backend} backend, got {t.dtype}")


def expect_bool(name, flag):
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {flag!r}")


def expect_indices(name, t, batch):
    expect_tensor(name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    expect_shape(name, t, (batch,), "[batch]")


def expect_no_overlap(name, t):
    # Written in place: elements sharing memory (an expanded tensor, an overlapping as_strided
    # view) would race. Sorted by stride, each dimension must step past all the inner ones.
    if any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} is written in place and must not have a zero stride (an expanded tensor), "
                         f"got strides {t.stride()}")
    reach = 0  # the largest offset the inner dimensions span
    dims = sorted(((abs(s), n) for n, s in zip(t.shape, t.stride()) if n > 1))
    for stride, size in dims:
        if stride <= reach:
            raise ValueError(f"{name} is written in place and its elements must not share memory, got shape "
                             f"{tuple(t.shape)} with strides {t.stride()}")
        reach += (size - 1) * stride


def expect_writable(name, t):
    """A buffer the op writes in place: checked before anything is written, so that a failing call
    leaves it as it was (torch's own errors for these come after a write)."""
    expect_no_overlap(name, t)
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name} was made under torch.inference_mode and is written in place: call the op "
                         f"inside torch.inference_mode() too, or pass a clone made outside it")
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} is written in place and must not require grad: call the op under "
                         f"torch.no_grad() or pass {name}.detach()")


def _on_host(t, limits) -> bool:
    """Indices whose values can be read without waiting for a GPU (a GPU backend's are CUDA
    tensors: its kernels treat an out-of-range index as a padding row instead)."""
    return limits.reads_host_indices and t.device.type == "cpu"


def _slot_checks(name, indices, state_name, slots) -> dict:
    """What must hold of a continuous-batching index tensor (negative: a padding row)."""
    real = indices >= 0
    slot = torch.where(real, indices, -1 - torch.arange(indices.numel(), device=indices.device))
    distinct = slot.sort().values
    return {f"{name} must be below {state_name}.shape[0] = {slots} (negative for a padding row), "
            f"got a larger index": indices < slots,
            f"{name} must not repeat a slot (two rows would update the same {state_name} row)":
                distinct[1:] != distinct[:-1] if indices.numel() > 1 else real | True}


def _check_weight_bias(weight, bias, dim, dtypes, backend: str) -> int:
    expect_tensor("weight", weight)
    if weight.ndim != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be [dim, width] with x's dim {dim}, got shape {tuple(weight.shape)}")
    width = weight.shape[1]
    if width not in CONV_WIDTHS:
        raise ValueError(f"width (last dimension of weight) must be one of {CONV_WIDTHS}, got {width}")
    expect_dtype("weight", weight, dtypes, backend)
    if bias is not None:
        expect_tensor("bias", bias)
        expect_shape("bias", bias, (dim,), "[dim]")
        expect_dtype("bias", bias, dtypes, backend)
    return width


def _check_activation(activation) -> bool:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, \"silu\" or \"swish\", got {activation!r}")
    return activation is not None
