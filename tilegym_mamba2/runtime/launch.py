"""The one place kernels are launched and their outputs allocated.

Ahead-of-time compilation records the launches the host code makes (kernel and arguments)
instead of running them; tests poison every output buffer with NaN so that an element a
kernel forgot to write cannot pass.
"""
import contextlib
import functools
import threading

from cuda.tile._cext import launch as _cutile_launch
import torch

class _Recording(threading.local):
    """Per thread: a first call records a replay (other_token_class.py) while another thread's
    launches must still run. A class attribute as the default: reading it costs ~40 ns a launch,
    where getattr with a default on a bare threading.local costs ~310 (it raises inside)."""
    launches: list | None = None


_recording = _Recording()
_poison = False


def launch(grid, kernel, args, *, dependent=False):
    """``dependent``: a programmatic dependent launch (Hopper and newer; the kernel must call
    ct.grid_dependency_control_wait before it reads anything the stream's previous kernel writes)."""
    recorded = _recording.launches
    if recorded is not None:
        recorded.append((kernel, tuple(args)))
        return
    device = args[0].get_device()
    # cuTile's own launch: importing tilegym replaces ct.launch with a Python wrapper (its
    # experimental-kernel warnings, ~0.3 us a call) that takes no keywords.
    if dependent and _dependent_launches(device):
        _cutile_launch(current_stream(device), grid, kernel, tuple(args), programmatic_dependent_launch=True)
    else:
        _cutile_launch(current_stream(device), grid, kernel, tuple(args))


@functools.cache
def _dependent_launches(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def current_stream(device_index: int):
    """The current stream of the device, as its raw handle (an int, which ct.launch takes as is):
    torch.cuda.current_stream builds a Stream object each time, ~4 us of host time per launch
    (docs/design.md, "Decisions"). The same stream, so graph capture sees the launches."""
    if _raw_stream is None:  # a torch without the raw query
        return torch.cuda.current_stream(device_index)
    return _raw_stream(device_index)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def tf32_mma(dtype) -> bool:
    """Whether our kernels' mma take fp32 operands as tf32: for fp32 inputs when PyTorch's float32
    matmul precision allows it (torch.set_float32_matmul_precision("high" or "medium"), the switch
    its own matmuls follow). At "highest", the default, fp32 operands stay fp32 (FMA, no tensor
    cores, tens of times slower: docs/performance.md, fp32 inputs)."""
    return dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"


def new_output(*shape, dtype, device):
    if _poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


@contextlib.contextmanager
def recording_launches():
    """Collects (kernel, args) for every launch this thread makes inside the block; nothing runs."""
    previous = _recording.launches
    _recording.launches = launches = []
    try:
        yield launches
    finally:
        _recording.launches = previous


@contextlib.contextmanager
def poisoned_outputs():
    """Every output allocated inside the block starts as NaN."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous
