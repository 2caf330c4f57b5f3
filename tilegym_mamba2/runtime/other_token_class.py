"""A call's kernels for the other token-count classes, compiled in the background after its first call.

cuTile compiles a kernel once per pattern of specialization bits of its arrays: each size's
divisibility by 16, whether each stride is a multiple of 16 bytes, whether the base address is
16-byte aligned. A token count T enters sizes (the token axis) and strides (a row of [batch, T]
int32 sequence ids is 4T bytes; of [batch, T, heads] fp32, 4 heads T), so T's class is its
power-of-two divisor up to 16: odd, 2, 4, 8 or 16 and more. A model's first count of a new class
compiles every kernel of its call again: 8.0 s for the 2.7B layer's forward and backward on the
H200, 6.7 s of it tileiras (docs/design.md, "First calls"). After a call that had no plan,
``compile_other_class`` replays the call's host code on meta tensors with the token count moved
to the nearest count of each other class with as many 64-token chunks, records its launches
without running them (launch.recording_launches), asks cuTile for the signature each launch
would compile (get_parameter_constraints_from_pyargs: what its dispatcher computes from the
arguments), and a daemon thread compiles the signatures not compiled yet, one at a time. Classes
that give a model the same bits (most do: with 80 heads every stride is a multiple of 16 bytes)
give the same signatures, compiled once. A call whose own signatures were all replayed as a
call's before (a shape of a class met before) replays nothing more.

cuTile's dispatcher calls a kernel's ``_compile`` when it has no binary for a signature; each kernel
a replay met gets one that first takes the background's result for that signature (waiting if it
is being compiled), so the first call of another class loads binaries instead of compiling.
The results also land in cuTile's disk cache. The thread starts a compile only when no compile of
a call has run for QUIET_S seconds: a call's own compiles wait for at most the one in progress.
It is on by default; TILEGYM_MAMBA2_PRECOMPILE=0 turns it off (nothing is then replayed or hooked).
"""
import dataclasses
import os
import queue
import threading
import time

import torch
from cuda.tile._cext import (CallingConvention, default_tile_context, get_compute_capability,
                             get_parameter_constraints_from_pyargs)
from cuda.tile.compilation import ArrayConstraint, KernelSignature, ListConstraint, TupleConstraint

from ..core.constants import KERNEL_CHUNK
from ..core.validation import fields
from .launch import recording_launches

SWITCH = "TILEGYM_MAMBA2_PRECOMPILE"
# The arguments with a token axis (axis 1: [batch, tokens, ...]).
TOKEN_FIELDS = frozenset(("x", "b", "c", "dt", "dout", "B", "C", "z", "seq_idx", "ungated"))
QUIET_S = 1.0
# A launch asks for constraints with every specialization cuTile has (a dimension of size 1
# becomes a constant, which only calling convention v2 conveys) and compiles with the lowest
# convention that conveys them (its C extension's make_signature).
_V1, _V2 = CallingConvention.cutile_python_v1(), CallingConvention.cutile_python_v2()

_lock = threading.Lock()
_seen: set = set()      # signatures compiled or queued, as _key gives them
_replayed: set = set()  # signatures of calls whose other classes were replayed
_ready: dict = {}       # _key -> _Compile queued for the thread, until a call takes it
_queue: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None
_pending = 0            # queued compiles the thread has not finished or skipped
_calls_compiling = 0    # compiles of calls in progress, and when the last one ended
_last_call_compile = 0.0
# Binaries the thread made and calls took, and replays that raised (their other class compiles
# on its own first call).
stats = {"compiled_in_background": 0, "taken": 0, "replays_failed": 0}


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def token_class(tokens: int) -> int:
    """The power of two dividing ``tokens``, up to 16: what cuTile's specialization bits can see of it."""
    return min(tokens & -tokens, 16)


def other_class_counts(tokens: int) -> list[int]:
    """For each class but ``tokens``' own, the nearest count of that class with as many 64-token
    chunks; none for 1 token (a decode-sized call: its classes are left to their own calls)."""
    if tokens <= 1:
        return []
    chunks = -(-tokens // KERNEL_CHUNK)
    low, high = KERNEL_CHUNK * (chunks - 1) + 1, KERNEL_CHUNK * chunks
    counts = []
    for wanted in (1, 2, 4, 8, 16):
        if wanted != token_class(tokens):
            # Every 16 consecutive counts hold each class, and a chunk's range holds 64 of them.
            counts.append(min((n for n in range(low, high + 1) if token_class(n) == wanted),
                              key=lambda n: abs(n - tokens)))
    return counts


def compile_other_class(replay, x, /, **named) -> None:
    """Unless TILEGYM_MAMBA2_PRECOMPILE=0, after a call's first run: ``replay(**named)`` runs its
    host code again on meta copies of ``named`` (tensors named in TOKEN_FIELDS, or a dataclass's or
    named tuple's fields so named, have the token axis of ``x``, the call's x). Never raises: a replay meta
    tensors cannot take leaves the other class to compile on its own call."""
    if enabled() and x.is_cuda and other_class_counts(x.shape[1]):
        with torch.cuda.device(x.device):  # the host code sizes launches for the current GPU (tuning.py)
            queue_other_class(replay, x.shape[1], torch.cuda.get_device_capability(x.device), named)


def queue_other_class(replay, tokens, capability, named) -> int:
    """compile_other_class for a call of ``tokens`` on a GPU of ``capability`` -> compiles queued."""
    try:
        # The call's own signatures are compiled already (in memory): never queued.
        own = [_key(kernel, signature, capability) for kernel, signature in _signatures(replay, named, tokens, tokens)]
        with _lock:
            # Not _seen: a call's own launches enter it as they compile, and another model's
            # replays may have queued them, yet their other classes are still unreplayed.
            if all(key in _replayed for key in own):
                return 0  # its class was met before, and every class was replayed then
            _replayed.update(own)
            _seen.update(own)
        others = [_signatures(replay, named, tokens, count) for count in other_class_counts(tokens)]
    except Exception:  # noqa: BLE001
        with _lock:
            stats["replays_failed"] += 1
        return 0
    return sum(_submit(_Compile(kernel, signature, capability)) for signatures in others
               for kernel, signature in signatures)


class _Compile:
    def __init__(self, kernel, signature, capability):
        self.kernel, self.signature, self.capability = kernel, signature, capability
        self.key = _key(kernel, signature, capability)
        self.started = False
        self.done = threading.Event()
        self.result = None


def _key(kernel, signature, capability):
    # KernelSignature compares by value but does not hash; its repr names every field.
    return id(kernel), repr(signature), tuple(capability)


def _signatures(replay, named, tokens, to_tokens):
    with recording_launches() as launches:
        replay(**{name: _on_meta(name, value, tokens, to_tokens) for name, value in named.items()})
    signatures = []
    for kernel, args in launches:
        _hook(kernel)
        signatures.append((kernel, _launch_signature(kernel, args)))
    return signatures


def _launch_signature(kernel, args):
    """The signature cuTile's dispatcher compiles for a launch of ``kernel`` on ``args``."""
    constraints = get_parameter_constraints_from_pyargs(kernel, args, _V2)
    return KernelSignature(constraints, _V2 if any(map(_needs_v2, constraints)) else _V1)


def _needs_v2(constraint) -> bool:
    if isinstance(constraint, ArrayConstraint):
        return any(size is not None for size in constraint.shape_constant)
    if isinstance(constraint, ListConstraint):
        return _needs_v2(constraint.element)
    return isinstance(constraint, TupleConstraint)


def _on_meta(name, value, tokens, to_tokens):
    """``value`` as a meta tensor (no memory, no device work), its token axis at ``to_tokens``."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_on_meta(field, item, tokens, to_tokens) for field, item in zip(value._fields, value)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{name: _on_meta(name, item, tokens, to_tokens)
                                             for name, item in fields(value).items()})
    if not isinstance(value, torch.Tensor):
        return value
    shape, stride = list(value.shape), list(value.stride())
    if name in TOKEN_FIELDS and value.ndim >= 2 and shape[1] == tokens:
        shape[1] = to_tokens
        if stride[0] % tokens == 0 and stride[0] >= tokens * stride[1]:  # rows one after another
            stride[0] = stride[0] // tokens * to_tokens
    # The storage offset stays: cuTile's signature records whether the base address is 16-byte aligned,
    # and a layer's x, B and C are views into one projection at offsets.
    offset = value.storage_offset()
    extent = offset + 1 + sum((size - 1) * step for size, step in zip(shape, stride) if size > 0)
    storage = torch.empty(extent, dtype=value.dtype, device="meta")
    return storage.as_strided(shape, stride, offset)


def _submit(job) -> bool:
    global _worker, _pending
    with _lock:
        if job.key in _seen:
            return False
        _seen.add(job.key)
        _ready[job.key] = job
        _pending += 1
        if _worker is None:
            _worker = threading.Thread(target=_work, name="tilegym-mamba2-precompile", daemon=True)
            _worker.start()
    _queue.put(job)
    return True


def _work():
    global _pending
    while True:
        job = _queue.get()
        while not _start(job):
            time.sleep(0.05)
        if job.started:
            try:
                job.result = type(job.kernel)._compile(job.kernel, job.signature, default_tile_context,
                                                       job.capability)
            except Exception:  # noqa: BLE001 - the call compiles it itself, and reports the error
                job.result = None
            job.done.set()
        with _lock:
            _pending -= 1
            stats["compiled_in_background"] += job.result is not None


def _start(job) -> bool:
    """Whether the thread is done waiting for ``job``: a call took it (not started), or no call
    has compiled for QUIET_S seconds (started)."""
    with _lock:
        if job.key not in _ready:
            return True
        if _calls_compiling or time.monotonic() - _last_call_compile < QUIET_S:
            return False
        job.started = True
        return True


def _hook(kernel) -> None:
    """Gives ``kernel`` a ``_compile`` that takes the background's result first (once per kernel)."""
    if "_compile" in vars(kernel):
        return
    compile_now = type(kernel)._compile

    def _compile(signature, *args, **kwargs):  # cuTile's: (signature, context, compute_capability=None)
        capability = kwargs.get("compute_capability", args[1] if len(args) > 1 else None)
        # cuTile's own _compile compiles for device 0's capability when given none.
        result = _take(_key(kernel, signature, capability or get_compute_capability()), signature)
        if result is not None:
            return result
        _call_compiling(+1)
        try:
            return compile_now(kernel, signature, *args, **kwargs)
        finally:
            _call_compiling(-1)

    kernel._compile = _compile


def _take(key, signature):
    """The background's binary for this signature (waiting while it compiles), or None."""
    with _lock:
        _seen.add(key)
        job = _ready.pop(key, None)
        if job is None or not job.started:
            return None  # not queued, or queued and not started: the thread skips it
    job.done.wait()
    if job.result is None or job.signature != signature:
        return None
    with _lock:
        stats["taken"] += 1
    return job.result


def _call_compiling(step):
    global _calls_compiling, _last_call_compile
    with _lock:
        _calls_compiling += step
        _last_call_compile = time.monotonic()


def wait_idle(timeout: float) -> bool:
    """Whether every queued compile has ended (or was taken by a call) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            if _pending == 0:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
