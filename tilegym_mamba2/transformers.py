"""Hugging Face transformers' Mamba-2 mixers on tilegym_mamba2's kernels.

The calling convention is tilegym.transformers' ``apply_tilegym_kernel_to_*``: boolean flags
for the pieces to replace, ``model`` for an already loaded model, ``use_cutile``, and nothing
returned. Call it before ``from_pretrained`` (``model=None``: the mixer classes are patched) or
on a loaded model (only that model's mixers are patched).

How the patch works. In transformers 5.3 every Mamba-2 mixer has two paths: ``torch_forward``
(pure torch, slow) and ``cuda_kernels_forward``, which calls five names that the modeling
module binds to mamba_ssm's and causal_conv1d's functions: ``causal_conv1d_fn``,
``causal_conv1d_update``, ``selective_state_update``, ``mamba_chunk_scan_combined`` and
``mamba_split_conv1d_scan_combined`` (the last only when training). When those packages are
missing the names are ``None`` and ``forward`` takes ``torch_forward``. Our serving API has the
same signatures, so the patched ``forward`` runs the mixer's own ``cuda_kernels_forward`` code
with those names bound to our functions. Cache handling, the prefill/decode decision,
padding masks and the gated RMSNorm are transformers' own code, and the patched mixer gives
the same results as the fast path would with mamba_ssm installed. The rebinding lives in a
private copy of the method's globals; the modeling module itself is left alone.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import types

import torch

import tilegym_mamba2

logger = logging.getLogger(__name__)

TESTED_TRANSFORMERS = "5.3"

# The functions cuda_kernels_forward calls, and the flag that chooses ours for each.
KERNELS = {
    "causal_conv1d_fn": "conv1d",
    "causal_conv1d_update": "conv1d",
    "mamba_chunk_scan_combined": "ssm",
    "selective_state_update": "ssm",
}
TRAINING_ONLY = "mamba_split_conv1d_scan_combined"

# (model type, mixer class) of the transformers models whose mixer this patch runs unchanged,
# each checked patched-vs-unpatched in tests/test_transformers.py. Not here: falcon_h1 (its
# cuda_kernels_forward enters torch.cuda.device, so it cannot be checked on a CPU), jamba and
# falcon_mamba (Mamba-1 mixers).
MIXERS = (
    ("mamba2", "Mamba2Mixer"),
    ("bamba", "BambaMixer"),
    ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    ("nemotron_h", "NemotronHMamba2Mixer"),
    ("zamba2", "Zamba2MambaMixer"),
)

_ORIGINAL = "_tilegym_mamba2_original"  # on our forward: the forward it replaced


def apply_tilegym_kernel_to_mamba2(
    conv1d: bool = True,
    ssm: bool = True,
    model: torch.nn.Module | None = None,
    use_cutile: bool = False,
) -> None:
    """Run transformers' Mamba-2 mixers (prefill and decode) on tilegym_mamba2's functions.

    Prefill: ``causal_conv1d_fn`` over the prompt and ``mamba_chunk_scan_combined`` (its final
    states fill the cache); decode: ``causal_conv1d_update`` and ``selective_state_update`` in
    place on the cache. Neither mamba_ssm nor causal_conv1d needs to be installed. Mixers in
    training mode, or called while autograd records (our kernels are forward-only), keep their
    own forward; ``generate()`` and ``torch.no_grad()`` / ``torch.inference_mode()`` calls use ours.

    Args:
        conv1d: replace ``causal_conv1d_fn`` and ``causal_conv1d_update``. When False the
            mixer calls what transformers found (causal_conv1d, if installed), else our
            "pytorch" backend.
        ssm: replace ``mamba_chunk_scan_combined`` and ``selective_state_update``; when False,
            mamba_ssm's if installed, else our "pytorch" backend.
        model: a loaded model: only its mixers are patched (instance attributes). None: the
            mixer classes are patched, so every model built afterwards (and before) uses ours.
        use_cutile: True runs every call on our cuTile kernels (CUDA tensors only). False (the
            default) picks cuTile for CUDA tensors and the pytorch backend for others, so a
            patched model runs on a CPU too.

    Calling it again replaces the earlier patch (flags included); it never stacks.
    ``revert_tilegym_kernel_to_mamba2`` undoes it.

    Raises:
        RuntimeError: the installed transformers' mixer is not shaped as this patch expects
            (the message names the transformers version).
        ValueError: ``model`` has no Mamba-2 mixer this patch knows.
    """
    backend = "cutile" if use_cutile else None
    if model is None:
        for cls, problem in _mixer_classes(import_missing=True):
            if problem is not None:
                if cls.__name__ == "Mamba2Mixer":
                    raise RuntimeError(problem)
                logger.warning("tilegym_mamba2: not patching %s: %s", cls.__qualname__, problem)
                continue
            original = _unpatched_forward(cls)
            cls.forward = _patched_forward(cls, original, conv1d, ssm, backend)
        return

    known = dict(_mixer_classes(import_missing=False))
    patched = 0
    forwards = {}
    for module in model.modules():
        cls = type(module)
        if cls not in known:
            continue
        if known[cls] is not None:
            raise RuntimeError(known[cls])
        if cls not in forwards:
            forwards[cls] = _patched_forward(cls, _unpatched_forward(cls), conv1d, ssm, backend)
        module.forward = types.MethodType(forwards[cls], module)
        patched += 1
    if patched == 0:
        names = ", ".join(name for _, name in MIXERS)
        raise ValueError(f"model: {type(model).__name__} has no Mamba-2 mixer that tilegym_mamba2 patches ({names})")


def revert_tilegym_kernel_to_mamba2(model: torch.nn.Module | None = None) -> None:
    """Undoes ``apply_tilegym_kernel_to_mamba2`` for the mixer classes (model None) or one model."""
    if model is None:
        for cls, _ in _mixer_classes(import_missing=False):
            forward = cls.__dict__.get("forward")
            if hasattr(forward, _ORIGINAL):
                cls.forward = getattr(forward, _ORIGINAL)
        return
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if hasattr(getattr(forward, "__func__", None), _ORIGINAL):
            del module.forward


def _mixer_classes(import_missing: bool):
    """(class, problem or None) for each supported mixer whose modeling module is importable
    (import_missing) or already imported."""
    for model_type, class_name in MIXERS:
        name = f"transformers.models.{model_type}.modeling_{model_type}"
        module = sys.modules.get(name)
        if module is None and import_missing:
            try:
                module = importlib.import_module(name)
            except ImportError:
                if model_type == "mamba2":
                    raise
                continue
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is None:
            if module is not None and model_type == "mamba2":
                raise RuntimeError(_version_message(f"{name} has no {class_name}"))
            continue
        yield cls, _structure_problem(cls)


def _unpatched_forward(cls):
    forward = cls.forward
    return getattr(forward, _ORIGINAL, forward)


def _structure_problem(cls) -> str | None:
    """Why the patch would not run ``cls`` as transformers 5.3's mixers are written, or None."""
    kernel_forward = getattr(cls, "cuda_kernels_forward", None)
    if not isinstance(kernel_forward, types.FunctionType):
        return _version_message(f"{cls.__qualname__} has no cuda_kernels_forward method")
    missing = [n for n in (*KERNELS, TRAINING_ONLY) if n not in kernel_forward.__code__.co_names]
    if missing:
        return _version_message(f"{cls.__qualname__}.cuda_kernels_forward no longer calls {', '.join(missing)}")
    forward_params = _named_params(_unpatched_forward(cls))
    kernel_params = _named_params(kernel_forward)
    if forward_params != kernel_params:
        return _version_message(
            f"{cls.__qualname__}.forward takes {forward_params} but cuda_kernels_forward takes {kernel_params}")
    return None


def _named_params(fn):
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


def _version_message(what: str) -> str:
    import transformers

    return (f"tilegym_mamba2.transformers cannot patch transformers {transformers.__version__}: {what} "
            f"(written for transformers {TESTED_TRANSFORMERS}; `pip install 'transformers>={TESTED_TRANSFORMERS},<5.4'`)")


def _patched_forward(cls, original, conv1d: bool, ssm: bool, backend):
    """A forward for ``cls`` that runs its cuda_kernels_forward on our functions."""
    kernel_forward = _rebound_kernel_forward(cls, {"conv1d": conv1d, "ssm": ssm}, backend)
    accepted = set(_named_params(kernel_forward))

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if self.training or _records_grad(self, args, kwargs):
            return original(self, *args, **kwargs)
        # Some mixers' forward also takes **kwargs, which cuda_kernels_forward does not.
        return kernel_forward(self, *args, **{k: v for k, v in kwargs.items() if k in accepted})

    setattr(forward, _ORIGINAL, original)
    return forward


def _records_grad(mixer, args, kwargs) -> bool:
    """Whether autograd would record this call (our kernels have no backward)."""
    if not torch.is_grad_enabled():
        return False
    hidden_states = args[0] if args else kwargs.get("hidden_states")
    return bool(getattr(hidden_states, "requires_grad", False)) or any(p.requires_grad for p in mixer.parameters())


def _rebound_kernel_forward(cls, flags: dict, backend):
    """``cls.cuda_kernels_forward`` with the kernel names bound to our functions (or, for a
    piece whose flag is off, to what transformers found, else our pytorch backend)."""
    source = cls.cuda_kernels_forward
    modeling = sys.modules[cls.__module__]
    scope = dict(vars(modeling))
    for name, piece in KERNELS.items():
        scope[name] = _ours(name, backend) if flags[piece] else _as_found(name, modeling)
    scope[TRAINING_ONLY] = _training_only
    bound = types.FunctionType(source.__code__, scope, source.__name__, source.__defaults__, source.__closure__)
    bound.__kwdefaults__ = source.__kwdefaults__
    bound.__qualname__ = source.__qualname__
    return bound


def _ours(name: str, backend):
    # Looked up at call time, so tilegym_mamba2's attribute is the one called.
    def call(*args, **kwargs):
        return getattr(tilegym_mamba2, name)(*args, backend=backend, **kwargs)

    call.__name__ = name
    return call


def _as_found(name: str, modeling):
    def call(*args, **kwargs):
        found = getattr(modeling, name, None)  # transformers rebinds these when it builds a mixer
        if found is None:
            return getattr(tilegym_mamba2, name)(*args, backend="pytorch", **kwargs)
        return found(*args, **kwargs)

    call.__name__ = name
    return call


def _training_only(*args, **kwargs):
    raise RuntimeError("tilegym_mamba2 offers no mamba_split_conv1d_scan_combined; a training-mode mixer "
                       "keeps its own forward")


__all__ = ["apply_tilegym_kernel_to_mamba2", "revert_tilegym_kernel_to_mamba2"]
