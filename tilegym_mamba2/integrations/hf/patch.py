"""Hugging Face transformers' Mamba-2 mixers on tilegym_mamba2's kernels.

The calling convention is tilegym.transformers' ``apply_tilegym_kernel_to_*``: boolean flags
for the pieces to replace, ``model`` for an already loaded model, ``use_cutile``, and nothing
returned. Call it before ``from_pretrained`` (``model=None``: the mixer classes are patched) or
on a loaded model (only that model's mixers are patched).

How the patch works. A Mamba-2 mixer's code calls five kernels by module-level names: a causal
convolution over the prompt and its one-token update, the chunked scan and its one-token
update, and a fused training kernel. Where those names are (structures.py) decides how ours
are plugged in:

- transformers 5.25's kernel-function wrappers (kernel_funcs.py): each mixer's own wrappers of
  the five functions get our ``forward``, as ``kernelize`` gives them a Hub kernel's;
- 5.3 to 5.24 (no per-mixer hook): a copy of the mixer's method runs with its global names
  resolving in a private copy of the module's globals, those five bound to our functions (a
  decorator around ``forward`` is copied around the copy); the modeling module is left alone.

Cache handling, the prefill/decode decision, padding masks and the gated RMSNorm stay
transformers' own code.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
import types

import torch

import tilegym_mamba2

from . import kernel_funcs
from .decode_graphs import check_graphable, disable_decode_graphs, enable_decode_graphs
from .norm_patch import (modeling_module, patch_norm_classes, patch_norm_modules, revert_norm_classes,
                         revert_norm_modules)
from .structures import (_ORIGINAL, MIXERS, holds, named_params, structure_of, unpatched_forward,
                         version_message, warn_if_newer)

logger = logging.getLogger(__name__)

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
    Works with the mixers of transformers 5.3 to 5.25 (structures.py); a newer release gets one
    warning, then the mixers it recognises are patched and the others refused.

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
    _check_arguments(conv1d=conv1d, ssm=ssm, model=model, use_cutile=use_cutile, cuda_graphs=cuda_graphs,
                     rms_norm=rms_norm, max_cache_len=max_cache_len)
    import transformers

    warn_if_newer(transformers.__version__)
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
        hooks = getattr(forwards[cls], "hooks", None)
        if hooks is not None:
            kernel_funcs.install(module, hooks)
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
                if hasattr(forward, "hooks"):  # its mixers' wrappers go back to their own at their next call
                    forward.hooks.active = False
        revert_norm_classes()
        return
    disable_decode_graphs(model)
    revert_norm_modules(model)
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if hasattr(getattr(forward, "__func__", None), _ORIGINAL):
            del module.forward
        kernel_funcs.uninstall(module)


def _check_arguments(*, conv1d, ssm, model, use_cutile, cuda_graphs, rms_norm, max_cache_len) -> None:
    """Names the argument at fault before anything is patched."""
    for name, value in (("conv1d", conv1d), ("ssm", ssm), ("use_cutile", use_cutile),
                        ("cuda_graphs", cuda_graphs), ("rms_norm", rms_norm)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a loaded transformers model) or None, got "
                        f"{type(model).__name__}")
    if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                      or max_cache_len < 1):
        raise ValueError(f"max_cache_len must be a positive int (key/value slots per sequence) or None, got "
                         f"{max_cache_len!r}")
    if max_cache_len is not None and not cuda_graphs:
        raise ValueError("max_cache_len: the key/value slots of decode graphs; it needs cuda_graphs=True")
    if use_cutile and model is not None:
        devices = {p.device.type for p in model.parameters()}
        if devices and devices != {"cuda"}:
            raise ValueError(f"use_cutile: the cuTile kernels take CUDA tensors, and model's parameters are on "
                             f"{', '.join(sorted(devices))} (move it with model.cuda(), or leave use_cutile False)")


def _mixer_classes(import_missing: bool):
    """(class, structure, problem) for each supported mixer whose modeling module is importable
    (import_missing) or already imported: structure None and problem the reason when the class
    is shaped as neither structure. Classes a structure leaves out are skipped."""
    for model_type, class_name in MIXERS:
        module = modeling_module(model_type, import_missing, required=model_type == "mamba2")
        cls = getattr(module, class_name, None)
        if cls is None:
            if module is not None and model_type == "mamba2":
                raise RuntimeError(version_message(f"{module.__name__} has no {class_name}"))
            continue
        structure, problem = structure_of(cls)
        if structure is not None and class_name in structure.left_out:
            continue
        yield cls, structure, problem


def _patched_forward(cls, structure, conv1d: bool, ssm: bool, backend):
    """A forward for ``cls`` that runs its ``structure.method`` on our functions."""
    if structure.method == "kernel_funcs":
        return _hooked_forward(cls, structure, conv1d, ssm, backend)
    original = unpatched_forward(cls)
    source = original if structure.method == "forward" else getattr(cls, structure.method)
    flags = {"conv1d": conv1d, "ssm": ssm}
    kernel_forward = _with_globals(source, _kernel_scope(source, structure, flags, backend))
    # Training: every piece differentiable. Mixers take the combined call, or (with a cache, or
    # some hybrids with masked inputs or without their memory-efficient path) the prefill and
    # decode pieces: there the scan is ours as it is (differentiable), the others the pytorch
    # backend's (PyTorch operations, which autograd follows).
    training_forward = _with_globals(source, _kernel_scope(source, structure, flags, backend, training=True))
    # 5.3: some mixers' forward also takes **kwargs, which cuda_kernels_forward does not.
    accepted = None if source is original else set(named_params(kernel_forward))

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


def _hooked_forward(cls, structure, conv1d: bool, ssm: bool, backend):
    """transformers' own forward, with the mixer's kernel-function wrappers pointed at ours
    (kernel_funcs.py): at patch time for a model's mixers, at a mixer's first call for a class
    patch. The first call checks that the forward went through the wrappers, so that a release
    that stops calling them is refused rather than run on its torch path under our name."""
    original = unpatched_forward(cls)
    flags = {"conv1d": conv1d, "ssm": ssm}
    hooks = kernel_funcs.Hooks(_pieces(structure, flags, backend, training=False),
                               _pieces(structure, flags, backend, training=True) if ssm else None)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        current = kernel_funcs.installed(self)
        if current is None:
            current = kernel_funcs.copied(self) or hooks
            kernel_funcs.install(self, current)
        if current.checked:
            return original(self, *args, **kwargs)
        before = current.calls
        out = original(self, *args, **kwargs)
        if current.calls == before:
            raise RuntimeError(version_message(f"{type(self).__qualname__}.forward ran none of its kernel "
                                               f"functions ({', '.join(structure.names)})"))
        current.checked = True
        return out

    setattr(forward, _ORIGINAL, original)
    forward.hooks = hooks
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
    """The globals of ``source``'s module with the structure's kernel names bound to ``_pieces``."""
    module_globals = inspect.unwrap(source).__globals__
    scope = _module_namespace(module_globals, structure, flags, backend, training)
    for name, fn in _pieces(structure, flags, backend, training).items():
        scope[name] = _as_found(name, structure.names[name], module_globals) if fn is None else fn
    return scope


def _pieces(structure, flags: dict, backend, training: bool) -> dict:
    """The structure's kernel names -> our functions (None for a piece whose flag is off: what
    transformers found); ``training``: differentiable pieces (the scans are; the convolution
    torch's, the decode pieces the pytorch backend's)."""
    differentiable = ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined")
    pieces = {}
    for name, ours in structure.names.items():
        if training and ours == "mamba_split_conv1d_scan_combined" and structure.fused_call_may_decline:
            pieces[name] = _declined  # the mixer's own pieces: its own norm, our scan
        elif training and ours == "causal_conv1d_fn" and flags["conv1d"]:
            pieces[name] = _training_conv
        elif flags[PIECES[ours]]:
            pieces[name] = _ours(ours, "pytorch" if training and ours not in differentiable else backend)
        else:
            pieces[name] = None
    return pieces


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
    """A copy of ``fn`` whose global names resolve in ``scope``. For a wrapper (structures.copyable),
    the wrapper is copied around a copy of the function it wraps; the wrapper's own globals stay."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        inner_copy = _with_globals(inner, scope)
        closure = tuple(types.CellType(inner_copy) if holds(cell, inner) else cell for cell in fn.__closure__)
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
