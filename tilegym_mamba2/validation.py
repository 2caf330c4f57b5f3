"""Argument checks shared by every backend: one place, one message style.

Errors name the argument and say what was expected. Value checks that would need a
device synchronisation (a < 0, dt > 0, no NaN) are not made: they would stall the stream.
"""
from typing import NamedTuple

import torch

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_SIZES = (16, 32, 64, 128, 256)
# cuTile tiles have power-of-two shapes and tensor-core matmuls need at least 16 along each side.
CUTILE_DIMS = (16, 32, 64, 128, 256)


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
    init_state as fp32. Raises TypeError (wrong type or dtype) or ValueError (wrong shape,
    size or device)."""
    for name, t in (("x", x), ("a", a), ("b", b), ("c", c), ("d", d), ("dt", dt)):
        _expect_tensor(name, t)
    if init_state is not None:
        _expect_tensor("init_state", init_state)

    _expect_rank("x", x, "[batch, tokens, heads, head_size]")
    batch, tokens, heads, head_size = x.shape
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if batch < 1 or tokens < 1 or heads < 1 or head_size < 1:
        raise ValueError(f"x [batch, tokens, heads, head_size] must have no empty dimension, got {tuple(x.shape)}")

    _expect_rank("b", b, "[batch, tokens, groups, state_size]")
    groups, state_size = b.shape[2], b.shape[3]
    _expect_shape("b", b, (batch, tokens, groups, state_size), "[batch, tokens, groups, state_size] with x's batch and tokens")
    _expect_shape("c", c, tuple(b.shape), "[batch, tokens, groups, state_size], the shape of b")
    for name, t in (("b", b), ("c", c)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if groups < 1 or heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups}), the third dimension of b and c")
    if state_size < 1:
        raise ValueError(f"state_size (last dimension of b and c) must be at least 1, got {state_size}")

    _expect_shape("dt", dt, (batch, tokens, heads), "[batch, tokens, heads]")
    _expect_shape("a", a, (heads,), "[heads]")
    _expect_shape("d", d, (heads,), "[heads]")
    for name, t in (("dt", dt), ("a", a), ("d", d)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if init_state is not None:
        _expect_shape("init_state", init_state, (batch, heads, head_size, state_size),
                      "[batch, heads, head_size, state_size]")
        if not init_state.is_floating_point():
            raise TypeError(f"init_state must be a floating-point tensor, got {init_state.dtype}")

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")

    tensors = {"x": x, "a": a, "b": b, "c": c, "d": d, "dt": dt}
    if init_state is not None:
        tensors["init_state"] = init_state
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    if backend == "cutile":
        _check_cutile_limits(x.device, head_size, state_size)

    return ForwardArgs(
        x.contiguous(), a.to(torch.float32).contiguous(), b.contiguous(), c.contiguous(),
        d.to(torch.float32).contiguous(), dt.contiguous(),
        None if init_state is None else init_state.to(torch.float32).contiguous(), chunk_size)


def _check_cutile_limits(device: torch.device, head_size: int, state_size: int):
    if device.type != "cuda":
        raise ValueError(f"the cutile backend needs CUDA tensors, got tensors on {device}; "
                         "move them with .cuda() or call with backend=\"pytorch\"")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ValueError(f"the cutile backend needs a GPU of compute capability 8.0 or newer, "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
    for name, size in (("head_size (last dimension of x)", head_size),
                       ("state_size (last dimension of b and c)", state_size)):
        if size not in CUTILE_DIMS:
            raise ValueError(f"{name} must be one of {CUTILE_DIMS} for the cutile backend, got {size}; "
                             "the pytorch backend takes any size")


def _expect_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _expect_rank(name, t, layout):
    if t.ndim != len(layout.split(",")):
        raise ValueError(f"{name} must be {layout} ({len(layout.split(','))} dimensions), got shape {tuple(t.shape)}")


def _expect_shape(name, t, shape, layout):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {layout} = {tuple(shape)}, got {tuple(t.shape)}")
