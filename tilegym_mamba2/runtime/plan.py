"""Launch plans: what a repeated call needs, worked out on its first call and remembered.

A call's signature is what its argument checks and its config depend on: each tensor's type,
shape, dtype and device; every other argument's type and value; the tuning switches of the
environment. The first call with a signature is checked in full and picks its config (tuning.py);
a later call with the same signature skips both, which were most of our Python's host time
(docs/design.md, Decisions: launch plans). A bad argument never gets a plan, so it
meets the full checks and their errors on every call.

Strides are not part of the forward ops' signatures: their conversions (contiguous, fp32) run on
every call, as no-ops when the tensors are already right, and cuTile specializes each launch on
what it is given. The decode-step ops (selective_state_update, causal_conv1d_update) have no
config; their plan is their launch's grid and constants, and their signatures hold strides
(strides=True): their checks (a state written in place must not be expanded) and their kernels'
modes (a dt expanded with stride 0 is read once per head) read them.

Nothing is remembered while a CUDA graph is being captured: there the config is the heuristic's
or a saved one, not a settled choice (tuning.py), and a later call outside the capture settles it.
"""
import contextlib
import sys
import threading
import time

import torch

from ..core.validation import value_checks_enabled
from .tuning import capturing, tuning_switches

MAX_PLANS = 4096  # distinct signatures kept; beyond that the oldest half is dropped
_plans: dict = {}

_SCALARS = frozenset((type(None), bool, int, float, str))


def signature(*args, strides=False) -> tuple | None:
    """The call's signature (a hashable tuple), or None where an argument is not a tensor, None,
    a number, a string, or a tuple or list of those (such a call is checked in full). With
    ``strides``, each tensor's strides are part of it."""
    if value_checks_enabled():  # the value checks read the values: every call is checked in full
        return None
    parts = []
    for value in args:
        kind = type(value)
        if kind in _SCALARS:  # the type too: True == 1 == 1.0, and the checks tell them apart
            parts.append((kind, value))
        elif isinstance(value, torch.Tensor):
            # requires_grad and inference: the in-place ops' checks read them (serving_validation)
            parts.append((kind, value.shape, value.dtype, value.device, strides and value.stride(),
                          value.requires_grad, value.is_inference()))
        elif (kind is tuple or kind is list) and all(type(item) in _SCALARS for item in value):
            parts.append((kind, *value, *map(type, value)))
        else:
            return None
    return (*parts, *tuning_switches())


def planned(key):
    """The plan remembered for ``key`` (None: not yet, or no key)."""
    return None if key is None else _plans.get(key)


def remember(key, plan) -> None:
    """Keeps ``plan`` for ``key``, except during graph capture (see the module docstring)."""
    if key is None or capturing():
        return
    if len(_plans) >= MAX_PLANS:
        for old in list(_plans)[:MAX_PLANS // 2]:
            _plans.pop(old, None)  # another thread may have dropped it
    _plans[key] = plan


def forget() -> None:
    """Drops every plan (tests; a changed tuning cache file)."""
    _plans.clear()


# A call without a plan may compile kernels (seconds each, cached on disk for later processes) and
# tune: past this many seconds it says so on stderr, and again when it is done.
NOTICE_AFTER_S = 1.0


@contextlib.contextmanager
def first_call_notice(op: str, shape):
    """Around a call that has no plan yet: a timer thread prints what is happening once the call has
    run NOTICE_AFTER_S seconds, and the call's time when it ends. A fast call prints nothing."""
    started = time.perf_counter()
    said = threading.Event()

    def say():
        said.set()
        print(f"[tilegym-mamba2] {op} {tuple(shape)}: first call of this signature, compiling its kernels "
              f"(kept in cuTile's disk cache for later processes) ...", file=sys.stderr, flush=True)

    timer = threading.Timer(NOTICE_AFTER_S, say)
    timer.daemon = True
    timer.start()
    try:
        yield said
    finally:
        timer.cancel()
        if said.is_set():
            print(f"[tilegym-mamba2] {op} {tuple(shape)}: ready after {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)
