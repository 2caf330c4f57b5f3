"""Argument checks shared by every backend: one place, one message style.

Errors name the argument and say what was expected. Value checks that would need a
device synchronisation (a < 0, dt > 0, no NaN) are not made: they would stall the stream.
"""
import functools
from typing import NamedTuple

import os

import torch

from .packing import seq_idx_from_cu_seqlens
from .tensors import compute_dtype

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The pytorch backend also takes float64 (and then computes in it), so that
# torch.autograd.gradcheck can run against it on a CPU.
PYTORCH_INPUT_DTYPES = INPUT_DTYPES + (torch.float64,)
CHUNK_SIZES = (16, 32, 64, 128, 256)
NO_LIMIT = (0.0, float("inf"))  # the default dt_limit: no clamp
# cuTile tiles have power-of-two shapes and tensor-core matmuls need at least 16 along each side.
CUTILE_DIMS = (16, 32, 64, 128, 256)
# mamba2_chunk_forward/backward also take state_size 512 (tilegym's own grid has it): the
# recurrence is separate per state column, so the cutile backend runs two halves of 256.
CUTILE_SPLIT_STATE = 512


class ForwardArgs(NamedTuple):
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    d: torch.Tensor
    dt: torch.Tensor
    init_state: torch.Tensor | None
    chunk_size: int


def check_forward_args(x, a, b, c, d, dt, init_state, chunk_size, *, backend: str) -> ForwardArgs:
    """Checks the mamba2_chunk_forward contract; returns contiguous tensors, with a, d and
    init_state in ``compute_dtype(x)`` (fp32, or float64 for float64 x on the pytorch backend).
    Raises TypeError (wrong type or dtype) or ValueError (wrong shape, size or device)."""
    batch, tokens, heads, head_size, groups, state_size = _check_scan_inputs(
        {"x": x, "a": a, "b": b, "c": c, "dt": dt}, backend)
    _expect_tensor("d", d)
    _expect_shape("d", d, (heads,), "[heads]")
    _expect_float("d", d)
    if init_state is not None:
        _expect_tensor("init_state", init_state)
        _expect_shape("init_state", init_state, (batch, heads, head_size, state_size),
                      "[batch, heads, head_size, state_size]")
        _expect_float("init_state", init_state)
    _check_chunk_size(chunk_size)
    _check_device({"x": x, "a": a, "b": b, "c": c, "d": d, "dt": dt, "init_state": init_state},
                  backend, head_size, state_size, split_state=True)
    if value_checks_enabled():
        check_values({"a must be negative (the decay exp(a dt) below 1), got a value >= 0": a < 0,
                      "dt must be >= 0 (it is after softplus), got a negative value": dt >= 0})
    return forward_args(x, a, b, c, d, dt, init_state, chunk_size)


def forward_args(x, a, b, c, d, dt, init_state, chunk_size) -> ForwardArgs:
    """check_forward_args' result without its checks, for arguments already known to pass them
    (cutile/plan.py): contiguous tensors, a, d and init_state in compute_dtype(x)."""
    dtype = compute_dtype(x)
    return ForwardArgs(x.contiguous(), _as(a, dtype), b.contiguous(), c.contiguous(), _as(d, dtype), dt.contiguous(),
                       _as(init_state, dtype), chunk_size)


def _as(t, dtype):
    """t as contiguous ``dtype`` (None stays None). The same tensor when it already is: a no-op
    .to() still costs ~0.7 us of host time."""
    if t is None:
        return None
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()


def _check_scan_inputs(named: dict, backend: str) -> tuple:
    """x, a, b, c, dt under the caller's names -> (batch, tokens, heads, head_size, groups, state_size)."""
    (nx, x), (na, a), (nb, b), (nc, c), (ndt, dt) = named.items()
    for name, t in named.items():
        _expect_tensor(name, t)
    _expect_rank(nx, x, "[batch, tokens, heads, head_size]")
    batch, tokens, heads, head_size = x.shape
    if backend == "pytorch" and x.dtype not in PYTORCH_INPUT_DTYPES:
        raise TypeError(f"{nx} must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if backend != "pytorch" and x.dtype not in INPUT_DTYPES:
        hint = " (the pytorch backend takes float64)" if x.dtype == torch.float64 else ""
        raise TypeError(f"{nx} must be bfloat16, float16 or float32 for the {backend} backend, "
                        f"got {x.dtype}{hint}")
    if batch < 1 or tokens < 1 or heads < 1 or head_size < 1:
        raise ValueError(f"{nx} [batch, tokens, heads, head_size] must have no empty dimension, got {tuple(x.shape)}")

    _expect_x_layout(nx, x, nb, b, ndt, dt)
    # b and c each on their own first, so that the one that is wrong is the one named.
    for name, t in ((nb, b), (nc, c)):
        _expect_rank(name, t, "[batch, tokens, groups, state_size]")
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
    _expect_shape(nc, c, tuple(b.shape), f"[batch, tokens, groups, state_size], the shape of {nb}")

    _expect_shape(ndt, dt, (batch, tokens, heads), "[batch, tokens, heads]")
    _expect_shape(na, a, (heads,), "[heads]")
    for name, t in ((ndt, dt), (na, a)):
        _expect_float(name, t)
    return batch, tokens, heads, head_size, groups, state_size


def _expect_x_layout(nx, x, nb, b, ndt, dt):
    """x in [batch, heads, tokens, head_size] order (a common slip) is named as x's mistake, not
    as b's or dt's: their tokens dimension is x's third."""
    batch, tokens, heads = x.shape[:3]
    if tokens == heads or not isinstance(b, torch.Tensor) or not isinstance(dt, torch.Tensor):
        return
    if b.ndim == 4 and b.shape[1] == heads and dt.ndim == 3 and tuple(dt.shape) == (batch, heads, tokens):
        raise ValueError(f"{nx} must be [batch, tokens, heads, head_size]; its shape {tuple(x.shape)} reads as "
                         f"[batch, heads, tokens, head_size] ({nb} and {ndt} have {heads} tokens): transpose "
                         f"{nx} to [batch, tokens, heads, head_size]")


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


def _check_device(tensors: dict, backend: str, head_size: int, state_size: int, split_state: bool = False):
    tensors = {n: t for n, t in tensors.items() if t is not None}
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    if backend == "cutile":
        _check_cutile_limits(next(iter(devices)), head_size, state_size, split_state)


def _check_cutile_limits(device: torch.device, head_size: int, state_size: int, split_state: bool = False):
    check_cutile_device(device)
    for name, size, sizes in (("head_size (last dimension of x)", head_size, CUTILE_DIMS),
                              ("state_size (last dimension of b and c)", state_size,
                               CUTILE_DIMS + ((CUTILE_SPLIT_STATE,) if split_state else ()))):
        if size not in sizes:
            raise ValueError(f"{name} must be one of {sizes} for the cutile backend, got {size}; "
                             "the pytorch backend takes any size")


def check_cutile_device(device: torch.device):
    """Every cutile op's device rule: CUDA, compute capability 8.0 or newer."""
    if device.type != "cuda":
        raise ValueError(f"the cutile backend needs CUDA tensors, got tensors on {device} (tilegym.ops runs "
                         f"cutile for a backend it has no implementation of, a misspelt name included); "
                         "move them with .cuda() or call with backend=\"pytorch\"")
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if major < 8:
        raise ValueError(f"the cutile backend needs a GPU of compute capability 8.0 or newer, "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


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


def _expect_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _expect_rank(name, t, layout):
    if t.ndim != len(layout.split(",")):
        raise ValueError(f"{name} must be {layout} ({len(layout.split(','))} dimensions), got shape {tuple(t.shape)}")


def _expect_float(name, t):
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _expect_shape(name, t, shape, layout):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {layout} = {tuple(shape)}, got {tuple(t.shape)}")


class ScanCombinedArgs(NamedTuple):
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    chunk_size: int
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    initial_states: torch.Tensor | None
    seq_idx: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    dt_softplus: bool
    dt_limit: tuple
    return_final_states: bool
    return_varlen_states: bool


def check_scan_flags(dt_softplus, dt_limit, return_final_states, return_varlen_states) -> None:
    """The layer op's arguments that are not tensors (the rest of check_scan_combined_args' checks
    run where the tensors are used)."""
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in dt_limit)):
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
                             backend: str) -> ScanCombinedArgs:
    """Checks the mamba_chunk_scan_combined contract (mamba_ssm's names and semantics).

    The order of cu_seqlens and seq_idx is checked on the host, which reads them (one small
    device-to-host copy each): a silently wrong answer costs more than that copy."""
    batch, tokens, heads, head_size, groups, state_size = _check_scan_inputs(
        {"x": x, "A": A, "B": B, "C": C, "dt": dt}, backend)
    _check_chunk_size(chunk_size)
    if D is not None:
        _expect_tensor("D", D)
        if tuple(D.shape) not in ((heads,), (heads, head_size)):
            raise ValueError(f"D must be [heads] = {(heads,)} or [heads, head_size] = {(heads, head_size)} "
                             f"(x's heads and head_size), got {tuple(D.shape)}")
        _expect_float("D", D)
    if z is not None:
        _expect_tensor("z", z)
        _expect_shape("z", z, tuple(x.shape), "[batch, tokens, heads, head_size], the shape of x")
        _expect_float("z", z)
    if dt_bias is not None:
        _expect_tensor("dt_bias", dt_bias)
        _expect_shape("dt_bias", dt_bias, (heads,), "[heads]")
        _expect_float("dt_bias", dt_bias)
    check_scan_flags(dt_softplus, dt_limit, return_final_states, return_varlen_states)

    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens, the sequences' start offsets")
    num_sequences = _check_packing(cu_seqlens, seq_idx, batch, tokens, x.device)

    if initial_states is not None:
        _expect_tensor("initial_states", initial_states)
        allowed = {(batch, heads, head_size, state_size)}
        if num_sequences is not None:
            allowed.add((num_sequences, heads, head_size, state_size))
        if tuple(initial_states.shape) not in allowed:
            layouts = " or ".join(str(s) for s in sorted(allowed))
            raise ValueError(f"initial_states must be [batch, heads, head_size, state_size]"
                             f"{' or [num_sequences, heads, head_size, state_size]' if num_sequences else ''}"
                             f" = {layouts} (x's batch, heads and head_size, B's state_size), got "
                             f"{tuple(initial_states.shape)}")
        _expect_float("initial_states", initial_states)

    _check_device({"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
                   "initial_states": initial_states, "seq_idx": seq_idx, "cu_seqlens": cu_seqlens},
                  backend, head_size, state_size)
    if value_checks_enabled():
        check_values({"A must be negative (the decay exp(A dt) below 1), got a value >= 0": A < 0})
    return scan_combined_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                              dt_softplus, dt_limit, return_final_states, return_varlen_states)


def scan_combined_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                       dt_softplus, dt_limit, return_final_states, return_varlen_states) -> ScanCombinedArgs:
    """check_scan_combined_args' result without its checks, for arguments already known to pass
    them (cutile/plan.py)."""
    def contiguous(t):
        return None if t is None else t.contiguous()

    dtype = compute_dtype(x)
    return ScanCombinedArgs(
        x.contiguous(), dt.contiguous(), _as(A, dtype), B.contiguous(), C.contiguous(), chunk_size, _as(D, dtype),
        contiguous(z), _as(dt_bias, dtype), _as(initial_states, dtype), contiguous(seq_idx), contiguous(cu_seqlens),
        dt_softplus, (float(dt_limit[0]), float(dt_limit[1])), return_final_states, return_varlen_states)


def _check_packing(cu_seqlens, seq_idx, batch, tokens, device) -> int | None:
    """Checks cu_seqlens and seq_idx -> the number of sequences of cu_seqlens (or None). Their
    device first (x's ``device``): their values are read, and a tensor elsewhere must be named,
    not read.

    Their values live on the device: every value check is computed there and read back in one
    transfer (each read waits for the queued GPU work, so a second read doubles the stall)."""
    flags = {}
    if cu_seqlens is not None:
        _expect_tensor("cu_seqlens", cu_seqlens)
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D int32 or int64 tensor [num_sequences + 1] of start "
                             f"offsets, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        if batch != 1:
            raise ValueError(f"cu_seqlens packs sequences along tokens and needs batch 1, got batch {batch}")
        _on_device("cu_seqlens", cu_seqlens, device)
        flags["cu_seqlens"] = ((cu_seqlens[0] == 0) & (cu_seqlens[-1] == tokens)
                               & (cu_seqlens[1:] > cu_seqlens[:-1]).all())
    if seq_idx is not None:
        _expect_tensor("seq_idx", seq_idx)
        if seq_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seq_idx must be an int32 or int64 tensor, got {seq_idx.dtype}")
        _expect_shape("seq_idx", seq_idx, (batch, tokens), "[batch, tokens]")
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
    return any(t is not None and (t.device.type == "meta" or is_fake(t)) for t in tensors)


class BackwardArgs(NamedTuple):
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    d: torch.Tensor
    dt: torch.Tensor
    init_state: torch.Tensor | None
    dout: torch.Tensor
    dfinal_state: torch.Tensor | None
    chunk_size: int


def check_backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size, *,
                        backend: str) -> BackwardArgs:
    """mamba2_chunk_backward's arguments: the forward's, plus dout (x's shape, cast to x's dtype)
    and dfinal_state ([batch, heads, head_size, state_size] or None, cast to fp32)."""
    check_forward_args(x, a, b, c, d, dt, init_state, chunk_size, backend=backend)
    batch, _, heads, head_size = x.shape
    state = (batch, heads, head_size, b.shape[3])
    _expect_tensor("dout", dout)
    _expect_shape("dout", dout, tuple(x.shape), "[batch, tokens, heads, head_size], the shape of x")
    _expect_float("dout", dout)
    if dfinal_state is not None:
        _expect_tensor("dfinal_state", dfinal_state)
        _expect_shape("dfinal_state", dfinal_state, state, "[batch, heads, head_size, state_size]")
        _expect_float("dfinal_state", dfinal_state)
    _check_device({"x": x, "dout": dout, "dfinal_state": dfinal_state}, backend, head_size, b.shape[3],
                  split_state=True)
    return backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size)


def backward_args(x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size) -> BackwardArgs:
    """check_backward_args' result without its checks, for arguments already known to pass them
    (cutile/plan.py)."""
    args = forward_args(x, a, b, c, d, dt, init_state, chunk_size)
    return BackwardArgs(*args[:7], _as(dout, x.dtype), _as(dfinal_state, torch.promote_types(x.dtype, torch.float32)),
                        chunk_size)
