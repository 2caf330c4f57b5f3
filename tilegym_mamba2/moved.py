"""Import paths of earlier releases, kept working: each old module name imports the module that
now holds its code, warning once (FutureWarning) with the new name.

The package was laid out by backend (cutile/, reference/, backward.py, autograd.py); it is now laid
out by op and stage (ssd/, with ssd/reference/ beside the kernels), the machinery every kernel
shares (runtime/) and the decode-time ops (serving/). Code that imported the old names keeps
running, so a user's upgrade is a warning to act on, not an ImportError.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

PACKAGE = __name__.rpartition(".")[0]

# old module (relative to the package) -> its new home; a tuple where its functions moved apart (the old
# name is then a module that finds each name in them, in order); None for an old package whose modules
# moved apart (it becomes an empty package that only holds the old submodule names).
MOVED = {
    "autograd": "ssd.autograd",
    "backward": "ssd.backward",
    "core.serving_validation": "serving.validation",
    "cutile": None,
    "cutile.chained_prefill": "ssd.chained_prefill",
    "cutile.chunk_cumsum": "ssd.chunk_cumsum",
    "cutile.chunk_grads": "ssd.chunk_grads",
    "cutile.chunk_states_walk": "ssd.chunk_states_walk",
    "cutile.compute_out": "ssd.compute_out",
    "cutile.config_store": "runtime.config_store",
    "cutile.end_state": "ssd.end_state",
    "cutile.forward": "ssd.forward",
    "cutile.fwd_pass_state": "ssd.fwd_pass_state",
    "cutile.gate_grads": "ssd.gate_grads",
    "cutile.group_scores": "ssd.group_scores",
    "cutile.launch": "runtime.launch",
    "cutile.other_token_class": "runtime.other_token_class",
    "cutile.plan": "runtime.plan",
    "cutile.scan": "ssd.scans",
    "cutile.scan_combined": "ssd.layer",
    "cutile.sequence_init": "ssd.sequence_init",
    "cutile.serving": "serving",
    "cutile.serving.causal_conv1d": "serving.causal_conv1d",
    "cutile.serving.causal_conv1d_update": "serving.causal_conv1d_update",
    "cutile.serving.custom_ops": "traced_ops",
    "cutile.serving.rms_norm": "serving.rms_norm",
    "cutile.serving.selective_state_update": "serving.selective_state_update",
    "cutile.tuning": "runtime.tuning",
    "cutile.varlen_states": "ssd.varlen_states",
    "reference": None,
    "reference.end_state": "ssd.reference.end_state",
    "reference.layer": ("ssd.reference.layer", "ssd.dt", "ssd.reference.gate_grads"),
    "reference.scan": ("ssd.reference.scans", "ssd.reference.chunk_grads", "ssd.reference.chunk_states_walk"),
    "reference.serving": "serving.reference",
    "reference.ssd": ("ssd.reference.forward", "ssd.reference.chunks"),
    "testing.fuzz": "fuzz",
}

_warned = set()


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new home (the same object, so state is shared)."""

    def __init__(self, old, new):
        self.old, self.new = old, new

    def create_module(self, spec):
        if self.new is None:
            package = types.ModuleType(spec.name, f"Moved: its modules now live in {PACKAGE}.ssd, "
                                                  f"{PACKAGE}.runtime and {PACKAGE}.serving.")
            package.__path__ = []
            return package
        if isinstance(self.new, tuple):
            return _merged(spec.name, [importlib.import_module(f"{PACKAGE}.{name}") for name in self.new])
        return importlib.import_module(f"{PACKAGE}.{self.new}")

    def exec_module(self, module):
        if self.old not in _warned:
            _warned.add(self.old)
            if self.new is None:
                where = f"its modules moved to {PACKAGE}.ssd, .runtime and .serving"
            elif isinstance(self.new, tuple):
                where = "its functions moved to " + ", ".join(f"{PACKAGE}.{name}" for name in self.new)
            else:
                where = f"import {PACKAGE}.{self.new} instead"
            warnings.warn(f"{PACKAGE}.{self.old} is an old import path: {where}; the old name will go in a "
                          f"later release", FutureWarning, stacklevel=2)


def _merged(name, homes):
    """A module whose attributes are read from ``homes``, the first that has each."""
    module = types.ModuleType(name, "Moved: " + ", ".join(home.__name__ for home in homes))

    def __getattr__(attr):
        for home in homes:
            if hasattr(home, attr):
                return getattr(home, attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r} (nor has any of its new homes)")

    module.__getattr__ = __getattr__
    return module


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        old = fullname[len(PACKAGE) + 1:]
        if old not in MOVED:
            return None
        new = MOVED[old]
        return importlib.util.spec_from_loader(fullname, _Alias(old, new), is_package=new is None or new == "serving")


def install():
    """Puts the finder first on sys.meta_path, once: before the path finder, which would otherwise
    load tilegym_mamba2.cutile.serving.rms_norm a second time from serving/'s folder."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
