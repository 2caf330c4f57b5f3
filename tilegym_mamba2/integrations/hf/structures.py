"""Where each transformers release's Mamba-2 mixers call their kernels, and how the patch plugs in.

Three layouts (``STRUCTURES``), each with the function that recognises a mixer class written its
way (``Structure.recognise``); a new release's layout is one more ``Structure``:

- 5.3: the mixer's ``cuda_kernels_forward`` calls ``causal_conv1d_fn``, ``causal_conv1d_update``,
  ``selective_state_update``, ``mamba_chunk_scan_combined`` and ``mamba_split_conv1d_scan_combined``,
  bound to mamba_ssm's and causal_conv1d's functions, or ``None`` when those are missing.
- 5.17 (5.15 to 5.24): one ``forward`` that calls ``causal_conv1d_fn``, ``causal_conv1d_update``,
  ``mamba2_selective_state_update``, ``mamba2_chunk_scan`` and ``mamba2_split_conv1d_scan_combined``,
  module functions that run a Hub kernel, mamba_ssm's or causal_conv1d's function when there is one,
  else transformers' own torch code (5.24 renames forward's ``cache_params`` to ``cache``).
- 5.25 (and any release with the kernels package's per-layer functions): the mixer class is
  decorated ``use_kernelized_func([...])`` over those five functions and two that own the cache
  (``causal_conv1d_forward``, ``mamba2_scan_forward``); kernels >= 0.19 gives every mixer instance a
  private wrapper of each (``mixer._kernel_funcs``, keyed by the kernel's layer name: mamba_ssm's
  and causal_conv1d's function names), and the module-level names route a call to the calling
  mixer's wrapper. That is the hook ``kernelize`` replaces; the patch replaces the same
  wrappers' ``forward`` (kernel_funcs.py), so one model's mixers change and no other's.

The first two are patched by running a copy of the method whose global names resolve to our
functions (patch.py); the third needs no copy. ``TESTED`` is the newest release the tests ran
under: a newer one gets one warning naming both, then the structure checks below decide.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
import warnings
from typing import Callable, Optional

TESTED = "5.25"  # the newest transformers release the patch was tested under

_ORIGINAL = "_tilegym_mamba2_original"  # on our forward: the forward it replaced


@dataclasses.dataclass(frozen=True)
class Structure:
    """Where one transformers release's Mamba-2 mixers call their kernels, and how to tell."""

    release: str  # the transformers release it was written against
    method: str  # the mixer method whose code calls the kernels ("kernel_funcs": none, the hook)
    names: dict  # module-level name the mixer's code calls -> our function
    # recognise(structure, cls) -> None where cls is not written this way, "" where it is and the
    # patch runs it, else why it is written this way but the patch cannot run it.
    recognise: Callable[["Structure", type], Optional[str]]
    left_out: tuple = ()  # mixer classes of MIXERS not patched under this structure
    # The mixer goes on with its own pieces when the fused training call returns None.
    fused_call_may_decline: bool = False

    def problem(self, cls) -> Optional[str]:
        return self.recognise(self, cls)


def _kernel_method(structure, cls):
    """5.3: a method of its own calls the kernels, taking what forward takes."""
    kernel_forward = getattr(cls, structure.method, None)
    if not isinstance(kernel_forward, types.FunctionType):
        return None
    missing = _not_called(kernel_forward, structure)
    if missing:
        return f"{cls.__qualname__}.{structure.method} no longer calls {', '.join(missing)}"
    forward_params, kernel_params = named_params(unpatched_forward(cls)), named_params(kernel_forward)
    if forward_params != kernel_params:
        return f"{cls.__qualname__}.forward takes {forward_params} but {structure.method} takes {kernel_params}"
    return ""


def _kernel_hook(structure, cls):
    """5.25: kernels' use_kernelized_func gives every instance a wrapper of each kernel function."""
    hooks = kernelized_names(cls)
    return "" if hooks is not None and set(structure.names) <= hooks else None


def _forward_calls(structure, cls):
    """5.17: forward itself calls the module-level kernel functions."""
    forward = unpatched_forward(cls)
    if not copyable(forward):
        return f"{cls.__qualname__}.forward is wrapped in a way this patch cannot copy"
    missing = _not_called(inspect.unwrap(forward), structure)
    if len(missing) == len(structure.names):
        return None
    hooks = kernelized_names(cls)
    if hooks is not None and missing:
        return (f"{cls.__qualname__}'s kernel functions (use_kernelized_func) lack "
                f"{', '.join(sorted(set(_KERNEL_NAMES) - hooks))}")
    return f"{cls.__qualname__}.forward no longer calls {', '.join(missing)}" if missing else ""


# The kernels' own names: 5.3's module-level names, and the layer names under which 5.25's mixers
# keep their wrappers.
_KERNEL_NAMES = {name: name for name in ("causal_conv1d_fn", "causal_conv1d_update", "selective_state_update",
                                         "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined")}
_NAMES_5_17 = {"causal_conv1d_fn": "causal_conv1d_fn", "causal_conv1d_update": "causal_conv1d_update",
               "mamba2_selective_state_update": "selective_state_update",
               "mamba2_chunk_scan": "mamba_chunk_scan_combined",
               "mamba2_split_conv1d_scan_combined": "mamba_split_conv1d_scan_combined"}

# Asked in this order: the first that recognises a mixer class decides (a 5.25 mixer's forward
# also calls 5.17's names, through the hook).
STRUCTURES = (
    Structure(
        release="5.3",
        method="cuda_kernels_forward",
        names=_KERNEL_NAMES,
        recognise=_kernel_method,
        # Its cuda_kernels_forward enters torch.cuda.device, so it cannot be checked on a CPU.
        left_out=("FalconH1Mixer",),
    ),
    Structure(release="5.25", method="kernel_funcs", names=_KERNEL_NAMES, recognise=_kernel_hook,
              fused_call_may_decline=True),
    Structure(release="5.17", method="forward", names=_NAMES_5_17, recognise=_forward_calls,
              fused_call_may_decline=True),
)

# (model type, mixer class) of the transformers models whose mixer this patch runs unchanged,
# each checked patched-vs-unpatched in tests/integrations/hf/test_hybrids.py (falcon_h1 from 5.17's
# structure on). Not here: jamba and falcon_mamba (Mamba-1 mixers).
MIXERS = (
    ("mamba2", "Mamba2Mixer"),
    ("bamba", "BambaMixer"),
    ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    ("nemotron_h", "NemotronHMamba2Mixer"),
    ("zamba2", "Zamba2MambaMixer"),
    ("falcon_h1", "FalconH1Mixer"),
)


def unpatched_forward(cls):
    forward = cls.forward
    return getattr(forward, _ORIGINAL, forward)


def structure_of(cls):
    """(the structure ``cls`` is written in, None), or (None, why the patch cannot run it)."""
    for structure in STRUCTURES:
        problem = structure.problem(cls)
        if problem == "":
            return structure, None
        if problem is not None:
            return None, version_message(problem)
    layouts = "; ".join(f"{s.release}: {s.recognise.__doc__.split(': ', 1)[1]}" for s in STRUCTURES)
    kernels_note = ("; its mixers plug kernels in through the kernels package's per-layer functions: "
                    "`pip install 'kernels>=0.19'`" if "mamba2_scan_forward" in _called(unpatched_forward(cls)) else "")
    method, forward_names = STRUCTURES[0].method, ", ".join(STRUCTURES[-1].names)
    return None, version_message(
        f"{cls.__qualname__} has no {method} method and its forward calls none of {forward_names}, in none of "
        f"the layouts the patch knows ({layouts}){kernels_note}")


def kernelized_names(cls):
    """The names of the functions kernels' ``use_kernelized_func`` gives each instance of ``cls`` a
    private wrapper of (kernels 0.19 on: the decorator's ``__init__`` and ``forward`` both hold
    the functions), or None where ``cls`` has no such hook (kernels 0.17 shared one object between
    all instances: no per-model hook there)."""
    init, forward = cls.__dict__.get("__init__"), unpatched_forward(cls)
    functions = _free_variable(init, "decorator_args")
    if functions is None or _free_variable(forward, "decorator_args") is not functions:
        return None
    names = [getattr(fn, "__name__", None) or getattr(fn, "kernel_layer_name", None) for fn in functions]
    return frozenset(name for name in names if name)


def _free_variable(fn, name):
    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    try:
        return fn.__closure__[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _called(fn) -> tuple:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code.co_names if code is not None else ()


def _not_called(fn, structure) -> list:
    names = _called(fn)
    return [n for n in structure.names if n not in names]


def copyable(fn) -> bool:
    """Whether patch.py's ``with_globals`` can copy ``fn``: a function, or a wrapper (functools.wraps)
    that holds the function it wraps in its closure, down to a function that wraps nothing."""
    while isinstance(fn, types.FunctionType):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return True
        if not any(holds(cell, inner) for cell in fn.__closure__ or ()):
            return False
        fn = inner
    return False


def holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def named_params(fn):
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


def _release(version: str) -> tuple:
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


_warned = set()


def warn_if_newer(version: str) -> bool:
    """One warning per process for a transformers release newer than ``TESTED``; -> whether it is."""
    newer = _release(version) > _release(TESTED)
    if newer and version not in _warned:
        _warned.add(version)
        warnings.warn(f"tilegym_mamba2: transformers {version} is newer than {TESTED}, the newest release this "
                      f"patch was tested under; it patches the mixers it recognises and refuses the others",
                      stacklevel=3)
    return newer


def version_message(what: str) -> str:
    import transformers

    known = ", ".join(sorted((s.release for s in STRUCTURES), key=_release))
    return (f"tilegym_mamba2.transformers cannot patch transformers {transformers.__version__}: {what} "
            f"(it knows the Mamba-2 mixers of transformers {known}, tested up to {TESTED}; "
            f"`pip install 'transformers=={TESTED}.*'`)")
