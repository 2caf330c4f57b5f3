"""Argument checks shared by every backend: one place, one message style.

Errors name the argument and say what was expected. Value checks that would need a
device synchronisation (a < 0, dt > 0, no NaN) are not made: they would stall the stream.
What differs between backends (dtypes, sizes, devices) is data, a backend's Limits: nothing
here knows a backend by its name.

The checks return the call as one keyword dataclass (ForwardArgs, ScanCombinedArgs,
BackwardArgs): a new option is a new field, and no caller depends on its position.
"""
import dataclasses
import functools
import operator
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .constants import CHUNK_SIZES, INPUT_DTYPES, NO_LIMIT
from .packing import seq_idx_from_cu_seqlens
from .tensors import compute_dtype


@dataclass(frozen=True)
class Limits:
    """What one backend takes. ``name`` appears in messages only."""
    name: str
    input_dtypes: tuple = INPUT_DTYPES
    head_sizes: tuple | None = None        # None: any size
    state_sizes: tuple | None = None
    split_state_sizes: tuple = ()          # state sizes the plain op runs in parts
    serving_max_state: int | None = None   # the widest state of the decode step
    # device -> None, or ValueError saying why the backend cannot run there
    check_device: Callable[[torch.device], None] | None = None
    # Index tensors on the CPU are checked by value (the reference reads them anyway).
    reads_host_indices: bool = False


# The float64 hint of a backend that does not take float64.
FLOAT64_HINT = " (the pytorch backend takes float64)"


def fields(args) -> dict:
    """A call's fields by name (shallow: its tensors are not copied)."""
    names, getter = _fields_of(type(args))
    return dict(zip(names, getter(args)))


def values(args) -> tuple:
    """A call's fields in their order: what a launch plan's signature is made of."""
    return _fields_of(type(args))[1](args)


@functools.cache
def _fields_of(kind) -> tuple:
    """(field names, one attrgetter of them all): reading a call runs no Python frame per field."""
    names = tuple(f.name for f in dataclasses.fields(kind))
    return names, operator.attrgetter(*names)


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardArgs:
    """mamba2_chunk_forward's call, checked."""
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    d: torch.Tensor
    dt: torch.Tensor
    init_state: torch.Tensor | None = None
    chunk_size: int = 128


def check_forward_args(x, a, b, c, d, dt, init_state, chunk_size, *, limits: Limits) -> ForwardArgs:
    """Checks the mamba2_chunk_forward contract; returns contiguous tensors, with a, d and
    init_state in ``compute_dtype(x)`` (fp32, or float64 for float64 x on the pytorch backend).
    Raises TypeError (wrong type or dtype) or ValueError (wrong shape, size or device)."""
    batch, tokens, heads, head_size, groups, state_size = _check_scan_inputs(
        {"x": x, "a": a, "b": b, "c": c, "dt": dt}, limits)
    expect_tensor("d", d)
    expect_shape("d", d, (heads,), "[heads]")
    expect_float("d", d)
    if init_state is not None:
        expect_tensor("init_state", init_state)
        expect_shape("init_state", init_state, (batch, heads, head_size, state_size),
                      "[batch, heads, head_size, state_size]")
        expect_float("init_state", init_state)
    _check_chunk_size(chunk_size)
    _check_device({"x": x, "a": a, "b": b, "c": c, "d": d, "dt": dt, "init_state": init_state},
                  limits, head_size, state_size, split_state=True)
    if value_checks_enabled():
        check_values({"a must be negative (the decay exp(a dt) below 1), got a value >= 0": a < 0,
                      "dt must be >= 0 (it is after softplus), got a negative value": dt >= 0})
    return forward_args(x, a, b, c, d, dt, init_state, chunk_size)


def forward_args(x, a, b, c, d, dt, init_state, chunk_size) -> ForwardArgs:
    """check_forward_args' result without its checks, for arguments already known to pass them
    (runtime/plan.py): contiguous tensors, a, d and init_state in compute_dtype(x)."""
    dtype = compute_dtype(x)
    return ForwardArgs(x=x.contiguous(), a=_as(a, dtype), b=b.contiguous(), c=c.contiguous(), d=_as(d, dtype),
                       dt=dt.contiguous(), init_state=_as(init_state, dtype), chunk_size=chunk_size)


def _as(t, dtype):
    """t as contiguous ``dtype`` (None stays None). The same tensor when it already is: a no-op
    .to() still costs ~0.7 us of host time."""
    if t is None:
        return None
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()


def _check_scan_inputs(named: dict, limits: Limits) -> tuple:
    """x, a, b, c, dt under the caller's names -> (batch, tokens, heads, head_size, groups, state_size)."""
    (nx, x), (na, a), (nb, b), (nc, c), (ndt, dt) = named.items()
    for name, t in named.items():
        expect_tensor(name, t)
    expect_rank(nx, x, "[batch, tokens, heads, head_size]")
    batch, tokens, heads, head_size = x.shape
    if x.dtype not in limits.input_dtypes:
        hint = FLOAT64_HINT if x.dtype == torch.float64 else ""
        raise TypeError(f"{nx} must be {dtype_names(limits.input_dtypes)} for the {limits.name} backend, "
                        f"got {x.dtype}{hint}")
    if batch < 1 or tokens < 1 or heads < 1 or head_size < 1:
        raise ValueError(f"{nx} [batch, tokens, heads, head_size] must have no empty dimension, got {tuple(x.shape)}")

    expect_x_layout(nx, x, nb, b, ndt, dt)
    # b and c each on their own first, so that the one that is wrong is the one named.
    for name, t in ((nb, b), (nc, c)):
        expect_rank(name, t, "[batch, tokens, groups, state_size]")
        if tuple(t.shape[:2]) != (batch, tokens):
            raise ValueError(f"{name} must be [batch, tokens, groups, state_size] with {nx}'s batch and tokens "
                             f"({batch}, {tokens}), got {tuple(t.shape)}")
        if t.shape[2] < 1 or heads % t.shape[2]:
            raise ValueError(f"{name}'s groups ({t.shape[2]}), its third dimension, must divide heads ({heads})")
        if t.shape[3] < 1:
            raise ValueError(f"state_size (last dimension of {name}) must be at least 1, got {t.shape[3]}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have {nx}'s dtype {x.dtype}, got {t.dtype}")
    groups, state_size = b.shape[2], b.shape[3]
    expect_shape(nc, c, tuple(b.shape), f"[batch, tokens, groups, state_size], the shape of {nb}")

    expect_shape(ndt, dt, (batch, tokens, heads), "[batch, tokens, heads]")
    expect_shape(na, a, (heads,), "[heads]")
    for name, t in ((ndt, dt), (na, a)):
        expect_float(name, t)
    return batch, tokens, heads, head_size, groups, state_size


def expect_x_layout(nx, x, nb, b, ndt, dt):
    """x in [batch, heads, tokens, head_size] order (a common slip) is named as x's mistake, not
    as b's or dt's: their tokens dimension is x's third."""
    batch, tokens, heads = x.shape[:3]
    if tokens == heads or not isinstance(b, torch.Tensor) or not isinstance(dt, torch.Tensor):
        return
    if b.ndim == 4 and b.shape[1] == heads and dt.ndim == 3 and tuple(dt.shape) == (batch, heads, tokens):
        raise ValueError(f"{nx} must be [batch, tokens, heads, head_size]; its shape {tuple(x.shape)} reads as "
                         f"[batch, heads, tokens, head_size] ({nb} and {ndt} have {heads} tokens): transpose "
                         f"{nx} to [batch, tokens, heads, head_size]")


def dtype_names(dtypes) -> str:
    """(torch.bfloat16, torch.float16, torch.float32) -> "bfloat16, float16 or float32"."""
    names = [str(d).replace("torch.", "") for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _check_chunk_size(chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        kind = type(chunk_size).__module__ + "." + type(chunk_size).__qualname__
        hint = ": pass int(chunk_size)" if hasattr(chunk_size, "__index__") and not isinstance(chunk_size, bool) else ""
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, a Python int, got {chunk_size!r} "
                         f"(a {kind}{hint})")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")


def _on_device(name: str, t: torch.Tensor, device: torch.device):
    if t.device != device:
        raise ValueError(f"all tensors must be on one device, got x on {device}, {name} on {t.device}")


def check_one_device(tensors: dict, limits: Limits) -> torch.device:
    """All given tensors on one device, one the backend runs on -> that device."""
    tensors = {n: t for n, t in tensors.items() if t is not None}
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    device = next(iter(devices))
    if limits.check_device is not None:
        limits.check_device(device)
    return device


def _check_device(tensors: dict, limits: Limits, head_size: int, state_size: int, split_state: bool = False):
    check_one_device(tensors, limits)
    extra = limits.split_state_sizes if split_state else ()
    for name, size, sizes in (("head_size (last dimension of x)", head_size, limits.head_sizes),
                              ("state_size (last dimension of b and c)", state_size,
                               None if limits.state_sizes is None else limits.state_sizes + extra)):
        if sizes is not None and size not in sizes:
            raise ValueError(f"{name} must be one of {sizes} for the {limits.name} backend, got {size}; "
                             "the pytorch backend takes any size")


VALUE_CHECKS = "TILEGYM_MAMBA2_CHECK_VALUES"


def value_checks_enabled() -> bool:
    """TILEGYM_MAMBA2_CHECK_VALUES=1: the ops also check values that live on the device (indices
    in range and distinct, A < 0, dt >= 0), one device-to-host read per call: for debugging, since
    the read waits for the GPU's queued work."""
    return os.environ.get(VALUE_CHECKS, "0") not in ("", "0")


def check_values(checks: dict) -> None:
    """{message: bool tensor that must be all True} -> ValueError with the first failing message;
    every flag read back in one transfer."""
    if not checks:
        return
    flags = torch.stack([t.all() for t in checks.values()]).tolist()
    for message, ok in zip(checks, flags):
        if not ok:
            raise ValueError(message)


def expect_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def expect_rank(name, t, layout):
    if t.ndim != len(layout.split(",")):
        raise ValueError(f"{name} must be {layout} ({len(layout.split(','))} dimensions), got shape {tuple(t.shape)}")


def expect_float(name, t):
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def expect_shape(name, t, shape, layout):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {layout} = {tuple(shape)}, got {tuple(t.shape)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScanCombinedArgs:
    """mamba_chunk_scan_combined's call (mamba_ssm's names), checked."""
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    chunk_size: int
    D: torch.Tensor | None = None
    z: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    initial_states: torch.Tensor | None = None
    seq_idx: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    dt_softplus: bool = False
    dt_limit: tuple = NO_LIMIT
    return_final_states: bool = False
    return_varlen_states: bool = False


def scan_combined_call(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                       cu_seqlens=None, dt_softplus=False, dt_limit=NO_LIMIT, return_final_states=False,
                       return_varlen_states=False) -> ScanCombinedArgs:
    """mamba_chunk_scan_combined's public arguments (positional as mamba_ssm takes them) as its
    call, unchecked."""
    return ScanCombinedArgs(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                            initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                            dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
                            return_varlen_states=return_varlen_states)


def check_scan_flags(dt_softplus, dt_limit, return_final_states, return_varlen_states) -> None:
    """The layer op's arguments that are not tensors (the rest of check_scan_combined_args' checks
    run where the tensors are used)."""
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or isinstance(dt_limit[0], bool) or not isinstance(dt_limit[0], (int, float))
            or isinstance(dt_limit[1], bool) or not isinstance(dt_limit[1], (int, float))):
        raise TypeError(f"dt_limit must be a pair of numbers (low, high), got {dt_limit!r}")
    if not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"dt_limit must have low <= high, got {tuple(dt_limit)}")
    for name, flag in (("dt_softplus", dt_softplus), ("return_final_states", return_final_states),
                       ("return_varlen_states", return_varlen_states)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")


def check_scan_combined_args(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                             seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                             return_final_states=False, return_varlen_states=False, *,
                             limits: Limits) -> ScanCombinedArgs:
    """Checks the mamba_chunk_scan_combined contract (mamba_ssm's names and semantics).

    The order of cu_seqlens and seq_idx is checked on the host, which reads them (one small
    device-to-host copy each): a silently wrong answer costs more than that copy."""
    batch, tokens, heads, head_size, groups, state_size = _check_scan_inputs(
        {"x": x, "A": A, "B": B, "C": C, "dt": dt}, limits)
    _check_chunk_size(chunk_size)
    if D is not None:
        expect_tensor("D", D)
        if tuple(D.shape) not in ((heads,), (heads, head_size)):
            raise ValueError(f"D must be [heads] = {(heads,)} or [heads, head_size] = {(heads, head_size)} "
                             f"(x's heads and head_size), got {tuple(D.shape)}")
        expect_float("D", D)
    if z is not None:
        expect_tensor("z", z)
        expect_shape("z", z, tuple(x.shape), "[batch, tokens, heads, head_size], the shape of x")
        expect_float("z", z)
    if dt_bias is not None:
        expect_tensor("dt_bias", dt_bias)
        expect_shape("dt_bias", dt_bias, (heads,), "[heads]")
        expect_float("dt_bias", dt_bias)
    check_scan_flags(dt_softplus, dt_limit, return_final_states, return_varlen_states)

    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens, the sequences' start offsets")
    num_sequences = _check_packing(cu_seqlens, seq_idx, batch, tokens, x.device)

    if initial_states is not None:
        expect_tensor("initial_states", initial_states)
        allowed = {(batch, heads, head_size, state_size)}
        if num_sequences is not None:
            allowed.add((num_sequences, heads, head_size, state_size))
        if tuple(initial_states.shape) not in allowed:
            layouts = " or ".join(str(s) for s in sorted(allowed))
            raise ValueError(f"initial_states must be [batch, heads, head_size, state_size]"
                             f"{' or [num_sequences, heads, head_size, state_size]' if num_sequences else ''}"
                             f" = {layouts} (x's batch, heads and head_size, B's state_size), got "
                             f"{tuple(initial_states.shape)}")
        expect_float("initial_states", initial_states)

    _check_device({"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
                   "initial_states": initial_states, "seq_idx": seq_idx, "cu_seqlens": cu_seqlens},
                  limits, head_size, state_size)
    if value_checks_enabled():
        check_values({"A must be negative (the decay exp(A dt) below 1), got a value >= 0": A < 0})
    return scan_combined_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                              dt_softplus, dt_limit, return_final_states, return_varlen_states)


def scan_combined_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                       dt_softplus, dt_limit, return_final_states, return_varlen_states) -> ScanCombinedArgs:
    """check_scan_combined_args' result without its checks, for arguments already known to pass
    them (runtime/plan.py)."""
    def contiguous(t):
        return None if t is None else t.contiguous()

    dtype = compute_dtype(x)
    return ScanCombinedArgs(
        x=x.contiguous(), dt=dt.contiguous(), A=_as(A, dtype), B=B.contiguous(), C=C.contiguous(),
        chunk_size=chunk_size, D=_as(D, dtype), z=contiguous(z), dt_bias=_as(dt_bias, dtype),
        initial_states=_as(initial_states, dtype), seq_idx=contiguous(seq_idx), cu_seqlens=contiguous(cu_seqlens),
        dt_softplus=dt_softplus, dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
        return_final_states=return_final_states, return_varlen_states=return_varlen_states)


def _check_packing(cu_seqlens, seq_idx, batch, tokens, device) -> int | None:
    """Checks cu_seqlens and seq_idx -> the number of sequences of cu_seqlens (or None). Their
    device first (x's ``device``): their values are read, and a tensor elsewhere must be named,
    not read.

    Their values live on the device: every value check is computed there and read back in one
    transfer (each read waits for the queued GPU work, so a second read doubles the stall)."""
    flags = {}
    if cu_seqlens is not None:
        expect_tensor("cu_seqlens", cu_seqlens)
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor [num_sequences + 1] of start "
                             f"offsets, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        if batch != 1:
            raise ValueError(f"cu_seqlens packs sequences along tokens and needs batch 1, got batch {batch}")
        _on_device("cu_seqlens", cu_seqlens, device)
        flags["cu_seqlens"] = ((cu_seqlens[0] == 0) & (cu_seqlens[-1] == tokens)
                               & (cu_seqlens[1:] > cu_seqlens[:-1]).all())
    if seq_idx is not None:
        expect_tensor("seq_idx", seq_idx)
        if seq_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seq_idx must be an int32 or int64 tensor, got {seq_idx.dtype}")
        expect_shape("seq_idx", seq_idx, (batch, tokens), "[batch, tokens]")
        _on_device("seq_idx", seq_idx, device)
        if cu_seqlens is not None:
            # Equal to the ids cu_seqlens defines implies sorted.
            flags["agree"] = (seq_idx == seq_idx_from_cu_seqlens(cu_seqlens, tokens)).all()
        elif tokens > 1:
            flags["sorted"] = (seq_idx[:, 1:] >= seq_idx[:, :-1]).all()
    if not flags or _values_unreadable(cu_seqlens, seq_idx):
        return None if cu_seqlens is None else cu_seqlens.numel() - 1
    ok = dict(zip(flags, torch.stack(list(flags.values())).tolist()))
    if not ok.get("cu_seqlens", True):
        offsets = cu_seqlens.tolist()
        raise ValueError(f"cu_seqlens must start at 0, rise strictly (every sequence at least one token) "
                         f"and end at tokens = {tokens}, got {offsets if len(offsets) <= 12 else '[...]'}")
    if not ok.get("agree", True):
        raise ValueError("seq_idx and cu_seqlens disagree: with both given, seq_idx must number the "
                         "sequences of cu_seqlens 0, 1, 2, ... in order")
    if not ok.get("sorted", True):
        raise ValueError("seq_idx must be sorted along tokens (each sequence one contiguous run of tokens)")
    return None if cu_seqlens is None else cu_seqlens.numel() - 1


def _values_unreadable(*tensors) -> bool:
    """Meta tensors, and the fake tensors torch.compile traces with, have shapes but no values: their
    offsets are checked where the call runs on real tensors."""
    if torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake
    for t in tensors:
        if t is not None and (t.device.type == "meta" or is_fake(t)):
            return True
    return False


@dataclass(frozen=True, kw_only=True, slots=True)
class BackwardArgs(ForwardArgs):
    """mamba2_chunk_backward's call, checked: the forward's and the output gradients."""
    dout: torch.Tensor
    dfinal_state: torch.Tensor | None = None


def check_backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, *,
                        limits: Limits) -> BackwardArgs:
    """mamba2_chunk_backward's arguments: the forward's, plus dout (x's shape, cast to x's dtype)
    and dfinal_state ([batch, heads, head_size, state_size] or None, cast to fp32)."""
    check_forward_args(x, a, b, c, d, dt, init_state, chunk_size, limits=limits)
    batch, _, heads, head_size = x.shape
    state = (batch, heads, head_size, b.shape[3])
    expect_tensor("dout", dout)
    expect_shape("dout", dout, tuple(x.shape), "[batch, tokens, heads, head_size], the shape of x")
    expect_float("dout", dout)
    if dfinal_state is not None:
        expect_tensor("dfinal_state", dfinal_state)
        expect_shape("dfinal_state", dfinal_state, state, "[batch, heads, head_size, state_size]")
        expect_float("dfinal_state", dfinal_state)
    _check_device({"x": x, "dout": dout, "dfinal_state": dfinal_state}, limits, head_size, b.shape[3],
                  split_state=True)
    return backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size)


def backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size) -> BackwardArgs:
    """check_backward_args' result without its checks, for arguments already known to pass them
    (runtime/plan.py)."""
    args = forward_args(x, a, b, c, d, dt, init_state, chunk_size)
    return BackwardArgs(**fields(args), dout=_as(dout, x.dtype),
                        dfinal_state=_as(dfinal_state, torch.promote_types(x.dtype, torch.float32)))
