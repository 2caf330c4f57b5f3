"""Reads ops_registry.yaml and registers its ops with tilegym's dispatcher.

Implementations are named "module:function" and imported on their first call, so
registering costs nothing and a backend's import errors surface only when it is used.
"""
import functools
import importlib
import importlib.resources
from dataclasses import dataclass
from typing import Callable

import yaml


@dataclass(frozen=True)
class OpEntry:
    name: str
    contract: str
    backends: dict          # backend name -> "module:function"
    fallback: str
    displaces: str | None   # where tilegym's own implementation of a taken slot moves


def registry_text() -> str:
    return importlib.resources.files("tilegym_mamba2").joinpath("ops_registry.yaml").read_text()


def load_registry(text: str | None = None) -> dict[str, OpEntry]:
    data = yaml.safe_load(registry_text() if text is None else text)
    ops = data.get("ops") if isinstance(data, dict) else None
    if not isinstance(ops, dict):
        raise ValueError("ops_registry.yaml: expected a mapping 'ops:' of op name -> entry")
    entries = {}
    for name, op in ops.items():
        if not isinstance(op, dict) or not isinstance(op.get("backends"), dict):
            raise ValueError(f"ops_registry.yaml: {name} must be a mapping with a 'backends:' mapping "
                             "of backend name -> 'module:function'")
        backends = dict(op["backends"])
        for backend, target in backends.items():
            if not isinstance(target, str) or target.count(":") != 1:
                raise ValueError(f"ops_registry.yaml: {name}.backends.{backend} must be "
                                 f"'module:function', got {target!r}")
        fallback = op.get("fallback")
        if fallback not in backends:
            raise ValueError(f"ops_registry.yaml: {name}.fallback {fallback!r} is not one of its "
                             f"backends {sorted(backends)}")
        entries[name] = OpEntry(name, op.get("contract", ""), backends, fallback, op.get("displaces"))
    return entries


@functools.cache
def shipped_registry() -> dict[str, OpEntry]:
    """The package's own ops_registry.yaml, parsed once per process."""
    return load_registry()


def resolve(target: str) -> Callable:
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


class LazyImpl:
    """A registered implementation that imports its target on first call."""

    # Recognised by this attribute rather than by class, so a reloaded module still knows its own.
    is_tilegym_mamba2_impl = True

    def __init__(self, target: str):
        self.target = target
        self.__module__, self.__name__ = target.split(":")
        self._impl = None

    def __call__(self, *args, **kwargs):
        if self._impl is None:
            self._impl = resolve(self.target)
        return self._impl(*args, **kwargs)

    def __repr__(self):
        return f"<tilegym_mamba2 implementation {self.target}>"


@functools.cache
def implementation(op: str, backend: str) -> Callable:
    """Our own implementation of ``op`` for ``backend``, without going through tilegym."""
    entry = shipped_registry()[op]
    if backend not in entry.backends:
        raise ValueError(f"backend must be one of {sorted(entry.backends)} for {op}, got {backend!r}")
    return resolve(entry.backends[backend])


@dataclass(frozen=True)
class Backends:
    """ops_registry.yaml's ``backends:`` (name -> "module:object", a backends/base.py Backend)
    and ``by_device:`` (a tensor's device type -> the backend a call without backend= takes;
    other devices take each op's fallback)."""
    targets: dict
    by_device: dict


def load_backends(text: str | None = None) -> Backends:
    data = yaml.safe_load(registry_text() if text is None else text) or {}
    targets, by_device = dict(data.get("backends") or {}), dict(data.get("by_device") or {})
    for name, target in targets.items():
        if not isinstance(target, str) or target.count(":") != 1:
            raise ValueError(f"ops_registry.yaml: backends.{name} must be 'module:object', got {target!r}")
    for device, name in by_device.items():
        if name not in targets:
            raise ValueError(f"ops_registry.yaml: by_device.{device} {name!r} is not one of backends {sorted(targets)}")
    return Backends(targets, by_device)


@functools.cache
def shipped_backends() -> Backends:
    return load_backends()


# Resolved backend objects and per-(op, device type) choices: plain dicts, which torch.compile
# traces through (the yaml lookups behind them import modules, which it cannot).
_objects: dict = {}
_choices: dict = {}


def backend_object(name: str):
    """The Backend object named ``name``, resolved once."""
    found = _objects.get(name)
    if found is None:
        targets = shipped_backends().targets
        if name not in targets:
            raise ValueError(f"backend must be one of {sorted(targets)}, got {name!r}")
        found = _objects[name] = resolve(targets[name])
    return found


def backend_for(op: str, backend, x) -> str:
    """The backend a call runs on: the one asked for, else the one ops_registry.yaml's by_device
    names for x's device (our kernels for CUDA tensors), or the op's fallback."""
    if backend is not None:
        return backend
    device = getattr(getattr(x, "device", None), "type", "cpu")
    choice = _choices.get((op, device))
    return _choose(op, device) if choice is None else choice


def _choose(op: str, device: str) -> str:
    entry = shipped_registry()[op]
    named = shipped_backends().by_device.get(device)
    choice = _choices[(op, device)] = named if named in entry.backends else entry.fallback
    _allowed[op] = frozenset(entry.backends)
    return choice


_allowed: dict = {}  # op -> its backend names


def backend_of(op: str, backend, x):
    """backend_for's choice as its Backend object; a name ``op`` has no backend of is refused, naming it."""
    name = backend_for(op, backend, x)
    allowed = _allowed.get(op)
    if allowed is None:
        _choose(op, "cpu")
        allowed = _allowed[op]
    if name not in allowed:
        raise ValueError(f"backend must be one of {sorted(allowed)} for {op}, got {name!r}")
    return backend_object(name)


def prepare() -> None:
    """Resolves every backend and every op's choice per device ahead of any call (the package's
    import runs it): calls under torch.compile then find them in plain dicts."""
    for name in shipped_backends().targets:
        backend_object(name)
    for op in shipped_registry():
        for device in ("cpu", "cuda", "meta"):
            _choose(op, device)


def install(entries: dict | None = None) -> bool:
    """Registers every op of ops_registry.yaml (or ``entries``) with tilegym; False when
    tilegym is absent. Refuses, before changing anything, an op that would shadow one of
    tilegym's own without being declared a drop-in."""
    try:
        import tilegym
        from tilegym.backend import dispatcher
    except ImportError:
        return False
    entries = shipped_registry() if entries is None else entries
    for entry in entries.values():
        check_not_shadowing(entry, tilegym.ops, dispatcher)
    for entry in entries.values():
        install_op(entry, tilegym.ops, dispatcher)
    return True


def _ours(impl) -> bool:
    """An implementation or public stub this package registered (tilegym's dispatch also files
    the stub under "default")."""
    return getattr(impl, "is_tilegym_mamba2_impl", False) or getattr(impl, "is_tilegym_mamba2_stub", False)


def check_not_shadowing(entry: OpEntry, ops_module, dispatcher) -> None:
    """RuntimeError when tilegym has an op of ``entry``'s name (implementations or a public
    function not ours) and the entry is not a declared drop-in (``displaces``)."""
    if entry.displaces:
        return
    theirs = sorted(b for b, impl in dispatcher._REGISTRY.get(entry.name, {}).items()
                    if not _ours(impl))
    public = getattr(ops_module, entry.name, None)
    if theirs or (public is not None and not _ours(public)):
        raise RuntimeError(
            f"tilegym_mamba2: ops_registry.yaml's op {entry.name!r} would shadow tilegym's own tilegym.ops."
            f"{entry.name} (backends {theirs}). Give the op a name of its own, or, if it meets tilegym's "
            f"contract for {entry.name}, declare it a drop-in with 'displaces: <backend name>' so that "
            f"tilegym's implementation stays reachable under that name.")


def install_op(entry: OpEntry, ops_module, dispatcher) -> None:
    # tilegym offers no public way to read a registered implementation, so a displaced one
    # is moved within its registry table directly.
    slots = dispatcher._REGISTRY.setdefault(entry.name, {})
    for backend, target in entry.backends.items():
        current = slots.get(backend)
        ours = getattr(current, "is_tilegym_mamba2_impl", False)
        if current is not None and not ours and entry.displaces:
            slots[entry.displaces] = current
        dispatcher.register_impl(entry.name, backend)(LazyImpl(target))
    if not hasattr(ops_module, entry.name):
        setattr(ops_module, entry.name,
                dispatcher.dispatch(entry.name, fallback_backend=entry.fallback)(_public_stub(entry)))


def _public_stub(entry: OpEntry) -> Callable:
    def stub(*args, **kwargs):
        raise NotImplementedError(f"{entry.name} has no implementation for the current backend")
    stub.__name__ = stub.__qualname__ = entry.name
    stub.__doc__ = entry.contract
    stub.is_tilegym_mamba2_stub = True   # functools.wraps carries it to the dispatching wrapper
    return stub
