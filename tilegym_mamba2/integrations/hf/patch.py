"""Hugging Face transformers' Mamba-2 mixers on tilegym_mamba2's kernels.

The calling convention is tilegym.transformers' ``apply_tilegym_kernel_to_*``: boolean flags
for the pieces to replace, ``model`` for an already loaded model, ``use_cutile``, and nothing
returned. Call it before ``from_pretrained`` (``model=None``: the mixer classes are patched) or
on a loaded model (only that model's mixers are patched).

How the patch works. A Mamba-2 mixer's code calls five kernels by module-level names: a causal
convolution over the prompt and its one-token update, the chunked scan and its one-token
update, and a fused training kernel. Transformers has laid this out in two ways (``STRUCTURES``):

- 5.3: the mixer's ``cuda_kernels_forward`` calls ``causal_conv1d_fn``,
  ``causal_conv1d_update``, ``selective_state_update``, ``mamba_chunk_scan_combined`` and
  ``mamba_split_conv1d_scan_combined``, bound to mamba_ssm's and causal_conv1d's functions, or
  ``None`` when those are missing (then ``forward`` takes ``torch_forward``).
- 5.17 (5.15 on; 5.24 renames forward's ``cache_params`` to ``cache``): there is one
  ``forward``; it calls ``causal_conv1d_fn``, ``causal_conv1d_update``,
  ``mamba2_selective_state_update``, ``mamba2_chunk_scan`` and
  ``mamba2_split_conv1d_scan_combined``, module functions that run a Hub kernel, mamba_ssm's or
  causal_conv1d's function when there is one, else transformers' own torch code.

The patch recognises the structure from the class, then runs a copy of that method whose
global names resolve in a private copy of the module's globals with those five names bound to
our functions (a decorator around ``forward`` is copied around the copy). Cache handling,
the prefill/decode decision, padding masks and the gated RMSNorm stay transformers' own code;
the modeling module itself is left alone.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import types

import torch

import tilegym_mamba2

from .decode_graphs import check_graphable, disable_decode_graphs, enable_decode_graphs
from .norm_patch import (modeling_module, patch_norm_classes, patch_norm_modules, revert_norm_classes,
                         revert_norm_modules)

logger = logging.getLogger(__name__)

# Our serving functions, and the flag that chooses ours for each.
PIECES = {
    "causal_conv1d_fn": "conv1d",
    "causal_conv1d_update": "conv1d",
    "mamba_chunk_scan_combined": "ssm",
    "selective_state_update": "ssm",
    "mamba_split_conv1d_scan_combined": "ssm",  # training: the whole mixer, differentiable
}
# The keyword arguments each accepts (taken now, before anything can stand in for them): the
# mixer's other keyword arguments are dropped, as transformers drops those its kernels lack.
_ACCEPTS = {name: frozenset(inspect.signature(getattr(tilegym_mamba2, name)).parameters) - {"backend"}
            for name in PIECES}


@dataclasses.dataclass(frozen=True)
class Structure:
    """Where one transformers release's Mamba-2 mixers call their kernels."""

    release: str  # the transformers release it was written against
    method: str  # the mixer method whose code calls the kernels
    names: dict  # module-level name that code calls -> our function
    left_out: tuple = ()  # mixer classes of MIXERS not patched under this structure
    # The mixer goes on with its own pieces when the fused training call returns None.
    fused_call_may_decline: bool = False


STRUCTURES = (
    Structure(
        release="5.3",
        method="cuda_kernels_forward",
        names={"causal_conv1d_fn": "causal_conv1d_fn", "causal_conv1d_update": "causal_conv1d_update",
               "selective_state_update": "selective_state_update",
               "mamba_chunk_scan_combined": "mamba_chunk_scan_combined",
               "mamba_split_conv1d_scan_combined": "mamba_split_conv1d_scan_combined"},
        # Its cuda_kernels_forward enters torch.cuda.device, so it cannot be checked on a CPU.
        left_out=("FalconH1Mixer",),
    ),
    Structure(
        release="5.17",
        method="forward",
        names={"causal_conv1d_fn": "causal_conv1d_fn", "causal_conv1d_update": "causal_conv1d_update",
               "mamba2_selective_state_update": "selective_state_update",
               "mamba2_chunk_scan": "mamba_chunk_scan_combined",
               "mamba2_split_conv1d_scan_combined": "mamba_split_conv1d_scan_combined"},
        fused_call_may_decline=True,
    ),
)

# (model type, mixer class) of the transformers models whose mixer this patch runs unchanged,
# each checked patched-vs-unpatched in tests/integrations/hf/test_hybrids.py (falcon_h1 under 5.17's
# structure only). Not here: jamba and falcon_mamba (Mamba-1 mixers).
MIXERS = (
    ("mamba2", "Mamba2Mixer"),
    ("bamba", "BambaMixer"),
    ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    ("nemotron_h", "NemotronHMamba2Mixer"),
    ("zamba2", "Zamba2MambaMixer"),
    ("falcon_h1", "FalconH1Mixer"),
)

_ORIGINAL = "_tilegym_mamba2_original"  # on our forward: the forward it replaced


def apply_tilegym_kernel_to_mamba2(
    conv1d: bool = True,
    ssm: bool = True,
    model: torch.nn.Module | None = None,
    use_cutile: bool = False,
    cuda_graphs: bool = False,
    rms_norm: bool = True,
    max_cache_len: int | None = None,
) -> None:
    """Run transformers' Mamba-2 mixers (prefill and decode) on tilegym_mamba2's functions.

    Prefill: ``causal_conv1d_fn`` over the prompt and ``mamba_chunk_scan_combined`` (its final
    states fill the cache); decode: ``causal_conv1d_update`` and ``selective_state_update`` in
    place on the cache. Training (a mixer in training mode): under 5.17 the mixer declines its
    fused call and runs its own pieces with our scan (differentiable) and the pytorch backend's
    other pieces, so its own gated norm; under 5.3, whose mixers cannot decline it, mixers with one
    group of B and C get our ``mamba_split_conv1d_scan_combined`` (with several, it would
    normalise per group, as mamba_ssm does, where transformers' norm spans the whole width: those
    keep their own forward in training). Neither mamba_ssm nor causal_conv1d needs to be
    installed. Other calls while autograd records (the conv and state-update kernels have no
    backward) keep their own forward; ``generate()`` and ``torch.no_grad()`` /
    ``torch.inference_mode()`` calls use ours.
    Works with the mixers of transformers 5.3 and 5.17 (``STRUCTURES``).

    Args:
        conv1d: replace the causal convolution and its update. When False the mixer calls what
            transformers found: under 5.3 causal_conv1d if installed, else our "pytorch"
            backend; under 5.17 transformers' own function (a Hub kernel or causal_conv1d if
            there is one, else its torch code).
        ssm: replace the chunked scan and the one-token state update; when False, as for conv1d
            with mamba_ssm.
        model: a loaded model: only its mixers are patched (instance attributes). None: the
            mixer classes are patched, so every model built afterwards (and before) uses ours.
        use_cutile: True runs every call on our cuTile kernels (CUDA tensors only). False (the
            default) picks cuTile for CUDA tensors and the pytorch backend for others, so a
            patched model runs on a CPU too.
        cuda_graphs: with ``model`` (a Mamba2ForCausalLM, or a Bamba, GraniteMoeHybrid, NemotronH,
            Zamba2 or FalconH1 causal LM, on CUDA), also decode through CUDA graphs:
            every decode step of ``generate()`` replays a graph of the whole step, captured once
            per batch-size bucket (decode_graphs.py; prefill stays eager).
        rms_norm: also run the RMSNorm and gated RMSNorm modules of Mamba2 and the hybrids on
            ``tilegym_mamba2.rms_norm`` (one kernel each, the same values; norm_patch.py; FalconH1
            keeps its own gated norm).
        max_cache_len: with ``cuda_graphs``, a hybrid's key/value slots per sequence; a generation
            past it decodes eagerly. None: chosen at the first decode step and doubled as needed.

    Calling it again replaces the earlier patch (flags included); it never stacks.
    ``revert_tilegym_kernel_to_mamba2`` undoes it.

    Raises:
        RuntimeError: the installed transformers' mixer is shaped as in neither structure (the
            message names the transformers version).
        ValueError: ``model`` has no Mamba-2 mixer this patch knows.
    """
    backend = "cutile" if use_cutile else None
    if cuda_graphs and model is None:
        raise ValueError("cuda_graphs: decode graphs belong to one model; pass model=")
    if cuda_graphs:
        check_graphable(model)  # before anything is patched
    if model is None:
        for cls, structure, problem in _mixer_classes(import_missing=True):
            if problem is not None:
                if cls.__name__ == "Mamba2Mixer":
                    raise RuntimeError(problem)
                logger.warning("tilegym_mamba2: not patching %s: %s", cls.__qualname__, problem)
                continue
            cls.forward = _patched_forward(cls, structure, conv1d, ssm, backend)
        revert_norm_classes()
        if rms_norm:
            patch_norm_classes(backend)
        return

    known = {cls: (structure, problem) for cls, structure, problem in _mixer_classes(import_missing=False)}
    patched = 0
    forwards = {}
    for module in model.modules():
        cls = type(module)
        if cls not in known:
            continue
        structure, problem = known[cls]
        if problem is not None:
            raise RuntimeError(problem)
        if cls not in forwards:
            forwards[cls] = _patched_forward(cls, structure, conv1d, ssm, backend)
        module.forward = types.MethodType(forwards[cls], module)
        patched += 1
    if patched == 0:
        names = ", ".join(name for _, name in MIXERS)
        raise ValueError(f"model: {type(model).__name__} has no Mamba-2 mixer that tilegym_mamba2 patches ({names})")
    revert_norm_modules(model)
    if rms_norm:
        patch_norm_modules(model, backend)
    if cuda_graphs:
        enable_decode_graphs(model, max_cache_len=max_cache_len)
    else:  # a call again replaces the patch, flags included
        disable_decode_graphs(model)


def revert_tilegym_kernel_to_mamba2(model: torch.nn.Module | None = None) -> None:
    """Undoes ``apply_tilegym_kernel_to_mamba2`` for the mixer classes (model None) or one model
    (its decode graphs too)."""
    if model is None:
        for cls, _, _ in _mixer_classes(import_missing=False):
            forward = cls.__dict__.get("forward")
            if hasattr(forward, _ORIGINAL):
                cls.forward = getattr(forward, _ORIGINAL)
        revert_norm_classes()
        return
    disable_decode_graphs(model)
    revert_norm_modules(model)
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if hasattr(getattr(forward, "__func__", None), _ORIGINAL):
            del module.forward


def _mixer_classes(import_missing: bool):
    """(class, structure, problem) for each supported mixer whose modeling module is importable
    (import_missing) or already imported: structure None and problem the reason when the class
    is shaped as neither structure. Classes a structure leaves out are skipped."""
    for model_type, class_name in MIXERS:
        module = modeling_module(model_type, import_missing, required=model_type == "mamba2")
        cls = getattr(module, class_name, None)
        if cls is None:
            if module is not None and model_type == "mamba2":
                raise RuntimeError(_version_message(f"{module.__name__} has no {class_name}"))
            continue
        structure, problem = _structure_of(cls)
        if structure is not None and class_name in structure.left_out:
            continue
        yield cls, structure, problem


def _unpatched_forward(cls):
    forward = cls.forward
    return getattr(forward, _ORIGINAL, forward)


def _structure_of(cls):
    """(the structure ``cls`` is written in, None), or (None, why the patch cannot run it)."""
    old, new = STRUCTURES
    kernel_forward = getattr(cls, old.method, None)
    if isinstance(kernel_forward, types.FunctionType):
        missing = _not_called(kernel_forward, old)
        if missing:
            return None, _version_message(f"{cls.__qualname__}.{old.method} no longer calls {', '.join(missing)}")
        forward_params = _named_params(_unpatched_forward(cls))
        kernel_params = _named_params(kernel_forward)
        if forward_params != kernel_params:
            return None, _version_message(
                f"{cls.__qualname__}.forward takes {forward_params} but {old.method} takes {kernel_params}")
        return old, None

    forward = _unpatched_forward(cls)
    if not _copyable(forward):
        return None, _version_message(f"{cls.__qualname__}.forward is wrapped in a way this patch cannot copy")
    missing = _not_called(inspect.unwrap(forward), new)
    if len(missing) == len(new.names):
        return None, _version_message(
            f"{cls.__qualname__} has no {old.method} method (transformers {old.release}'s structure) and its "
            f"forward calls none of {', '.join(new.names)} ({new.release}'s)")
    if missing:
        return None, _version_message(f"{cls.__qualname__}.forward no longer calls {', '.join(missing)}")
    return new, None


def _not_called(fn, structure) -> list:
    code = getattr(fn, "__code__", None)
    names = code.co_names if code is not None else ()
    return [n for n in structure.names if n not in names]


def _copyable(fn) -> bool:
    """Whether ``_with_globals`` can copy ``fn``: a function, or a wrapper (functools.wraps) that
    holds the function it wraps in its closure, down to a function that wraps nothing."""
    while isinstance(fn, types.FunctionType):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return True
        if not any(_holds(cell, inner) for cell in fn.__closure__ or ()):
            return False
        fn = inner
    return False


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _named_params(fn):
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


def _version_message(what: str) -> str:
    import transformers

    known = " and ".join(s.release for s in STRUCTURES)
    return (f"tilegym_mamba2.transformers cannot patch transformers {transformers.__version__}: {what} "
            f"(it knows the Mamba-2 mixers of transformers {known}; "
            f"`pip install 'transformers=={STRUCTURES[-1].release}.*'`)")


def _patched_forward(cls, structure, conv1d: bool, ssm: bool, backend):
    """A forward for ``cls`` that runs its ``structure.method`` on our functions."""
    original = _unpatched_forward(cls)
    source = original if structure.method == "forward" else getattr(cls, structure.method)
    flags = {"conv1d": conv1d, "ssm": ssm}
    kernel_forward = _with_globals(source, _kernel_scope(source, structure, flags, backend))
    # Training: every piece differentiable. Mixers take the combined call, or (with a cache, or
    # some hybrids with masked inputs or without their memory-efficient path) the prefill and
    # decode pieces: there the scan is ours as it is (differentiable), the others the pytorch
    # backend's (PyTorch operations, which autograd follows).
    training_forward = _with_globals(source, _kernel_scope(source, structure, flags, backend, training=True))
    # 5.3: some mixers' forward also takes **kwargs, which cuda_kernels_forward does not.
    accepted = None if source is original else set(_named_params(kernel_forward))

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if self.training:
            if not (ssm and (structure.fused_call_may_decline or _one_group(self))):
                return original(self, *args, **kwargs)
            run = training_forward
        elif _records_grad(self, args, kwargs):
            return original(self, *args, **kwargs)
        else:
            run = kernel_forward
        if accepted is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return run(self, *args, **kwargs)

    setattr(forward, _ORIGINAL, original)
    return forward


def _one_group(mixer) -> bool:
    """One group of B and C: then mamba_ssm's fused training call (ours too) and the mixer's own
    gated norm agree; with several, the fused call normalises per group and most transformers
    mixers over the whole width."""
    return getattr(mixer, "n_groups", None) == 1


def _records_grad(mixer, args, kwargs) -> bool:
    """Whether autograd would record this call (our kernels have no backward)."""
    if not torch.is_grad_enabled():
        return False
    hidden_states = args[0] if args else kwargs.get("hidden_states")
    return bool(getattr(hidden_states, "requires_grad", False)) or any(p.requires_grad for p in mixer.parameters())


def _kernel_scope(source, structure, flags: dict, backend, training=False) -> dict:
    """The globals of ``source``'s module with the structure's kernel names bound to our
    functions (or, for a piece whose flag is off, to what transformers found); ``training``:
    differentiable pieces (the scans are; the convolution torch's, the decode pieces the pytorch
    backend's)."""
    module_globals = inspect.unwrap(source).__globals__
    scope = _module_namespace(module_globals, structure, flags, backend, training)
    differentiable = ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined")
    for name, ours in structure.names.items():
        if training and ours == "mamba_split_conv1d_scan_combined" and structure.fused_call_may_decline:
            scope[name] = _declined  # the mixer's own pieces: its own norm, our scan
        elif training and ours == "causal_conv1d_fn" and flags["conv1d"]:
            scope[name] = _training_conv
        elif flags[PIECES[ours]]:
            scope[name] = _ours(ours, "pytorch" if training and ours not in differentiable else backend)
        else:
            scope[name] = _as_found(name, ours, module_globals)
    return scope


def _module_namespace(module_globals, structure, flags, backend, training) -> dict:
    """A copy of a modeling module's globals, as the namespace of a module of its own in
    sys.modules: torch.compile names a function's globals by their ``__name__`` when it guards
    them, so they must not claim to be the modeling module's (whose kernel names are not ours)."""
    name = (f"tilegym_mamba2.patched.{module_globals['__name__']}."
            f"{'_'.join(k for k, on in sorted(flags.items()) if on) or 'none'}_{backend or 'auto'}"
            f"{'_training' if training else ''}")
    module = types.ModuleType(name)
    module.__dict__.update({k: v for k, v in module_globals.items() if k not in ("__name__", "__spec__",
                                                                                  "__loader__")})
    sys.modules[name] = module
    return module.__dict__


def _with_globals(fn, scope: dict):
    """A copy of ``fn`` whose global names resolve in ``scope``. For a wrapper (``_copyable``),
    the wrapper is copied around a copy of the function it wraps; the wrapper's own globals stay."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        inner_copy = _with_globals(inner, scope)
        closure = tuple(types.CellType(inner_copy) if _holds(cell, inner) else cell for cell in fn.__closure__)
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__ = fn.__qualname__
    if inner is not None:
        copy.__wrapped__ = inner_copy
    return copy


def _ours(name: str, backend):
    accepts = _ACCEPTS[name]

    # Looked up at call time, so tilegym_mamba2's attribute is the one called.
    def call(*args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in accepts}
        return getattr(tilegym_mamba2, name)(*args, backend=backend, **kwargs)

    call.__name__ = name
    return call


def _training_conv(*args, **kwargs):
    """The prefill convolution in training: differentiable, torch's conv1d where it applies."""
    from ...backends.split_conv1d_scan import causal_conv1d_differentiable

    return causal_conv1d_differentiable(*args, **{k: v for k, v in kwargs.items() if k in _ACCEPTS["causal_conv1d_fn"]})


def _declined(*args, **kwargs):
    """5.17's fused training call, declined: the mixer then runs its prefill pieces."""
    return None


def _as_found(name: str, ours: str, module_globals: dict):
    def call(*args, **kwargs):
        found = module_globals.get(name)  # read now: transformers 5.3 rebinds these when it builds a mixer
        if found is None:
            return _ours(ours, "pytorch")(*args, **kwargs)
        return found(*args, **kwargs)

    call.__name__ = name
    return call


__all__ = ["apply_tilegym_kernel_to_mamba2", "revert_tilegym_kernel_to_mamba2"]
