"""Hugging Face's Mamba-2 norms on ``tilegym_mamba2.rms_norm``: one kernel where torch runs ten.

A Mamba2ForCausalLM block normalises its input (Mamba2RMSNorm) and its mixer gates and
normalises the scan's output (MambaRMSNormGated); the hybrids' blocks do the same with their own
classes of the same arithmetic (NORMS). In torch each is ~10 kernels over fp32 copies
of the row; in a graph-replayed decode step of the 2.7B shape they were 17 of the 29 kernels of
a layer. ``rms_norm`` computes what those forwards compute, the rounding to the input's dtype
before the weight included, so a patched model's activations stay HF's own (bit for bit on the
pytorch backend).

The norms are patched the way patch.py patches the mixers: on the classes (model None)
or on one model's modules. A call that autograd would record keeps the module's own forward
(``rms_norm`` has no backward).
"""
import functools
import importlib
import inspect
import logging
import sys
import types

import torch

import tilegym_mamba2

from ...backends.pytorch import rms_norm_pytorch

# (model type, class, whether its forward takes a gate). The hybrids' norms compute what Mamba2's
# do (Zamba2's and NemotronH's gated ones per group of their ``group_size``); each is patched only
# where a probe finds it equal to rms_norm (same_arithmetic). FalconH1's gated norm is not listed:
# it applies the weight before rounding and may gate after the norm.
NORMS = (
    ("mamba2", "MambaRMSNormGated", True),  # Mamba2RMSNormGated from transformers 5.25
    ("mamba2", "Mamba2RMSNormGated", True),
    ("mamba2", "Mamba2RMSNorm", False),
    ("bamba", "BambaRMSNormGated", True),
    ("bamba", "BambaRMSNorm", False),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", True),
    ("granitemoehybrid", "GraniteMoeHybridRMSNorm", False),
    ("nemotron_h", "NemotronHRMSNormGated", True),
    ("nemotron_h", "NemotronHRMSNorm", False),
    ("zamba2", "Zamba2RMSNormGated", True),
    ("zamba2", "Zamba2RMSNorm", False),
    ("falcon_h1", "FalconH1RMSNorm", False),
)
_ORIGINAL = "_tilegym_mamba2_original_norm"
logger = logging.getLogger(__name__)


def modeling_module(model_type: str, import_missing: bool, required: bool = False):
    """transformers' modeling module of ``model_type`` when it is imported (or, with
    ``import_missing``, importable), else None; ``required``: its ImportError propagates."""
    name = f"transformers.models.{model_type}.modeling_{model_type}"
    module = sys.modules.get(name)
    if module is None and import_missing:
        try:
            module = importlib.import_module(name)
        except ImportError:
            if required:
                raise
    return module


def norm_classes(import_missing: bool, patchable_only: bool = False):
    """(class, gated) of each NORMS class whose modeling module is imported (or importable);
    ``patchable_only``: of those whose forward computes what rms_norm does (same_arithmetic)."""
    for model_type, class_name, gated in NORMS:
        cls = getattr(modeling_module(model_type, import_missing), class_name, None)
        if cls is not None and (not patchable_only or same_arithmetic(cls, gated)):
            yield cls, gated


@functools.cache
def same_arithmetic(cls, gated: bool) -> bool:
    """Whether ``cls``'s own forward equals rms_norm bit for bit on a bf16 probe (random weight,
    two groups where its constructor takes a ``group_size``). A class whose rounding moved (from
    transformers 5.22 NemotronHRMSNorm applies its weight in fp32 before rounding) keeps its own
    forward rather than change a model's values."""
    forward = cls.forward
    forward = getattr(forward, _ORIGINAL, forward)
    gen = torch.Generator().manual_seed(0)
    width = 64
    x, gate = (torch.randn(3, width, generator=gen).to(torch.bfloat16) for _ in range(2))
    module = types.SimpleNamespace(weight=(4 * torch.randn(width, generator=gen)).to(torch.bfloat16),
                                   variance_epsilon=1e-5)
    if "group_size" in inspect.signature(cls.__init__).parameters:
        module.group_size = width // 2
    try:
        with torch.no_grad():
            want = forward(module, x, gate) if gated else forward(module, x)
    except Exception as e:  # noqa: BLE001 (a forward that needs more of its module than the probe has)
        logger.info("tilegym_mamba2: %s keeps its own forward (the probe failed: %s)", cls.__qualname__, e)
        return False
    # The backend itself, not the public call: the probe is no user's call.
    got = rms_norm_pytorch(x, module.weight, gate if gated else None, module.variance_epsilon,
                           getattr(module, "group_size", None))
    same = want.dtype == got.dtype and torch.equal(want, got)
    if not same:
        logger.info("tilegym_mamba2: %s keeps its own forward (it rounds otherwise than rms_norm)", cls.__qualname__)
    return same


def patch_norm_classes(backend) -> None:
    for cls, gated in norm_classes(import_missing=True, patchable_only=True):
        cls.forward = patched_norm_forward(cls, gated, backend)


def revert_norm_classes() -> None:
    for cls, _ in norm_classes(import_missing=False):
        forward = cls.__dict__.get("forward")
        if hasattr(forward, _ORIGINAL):
            cls.forward = getattr(forward, _ORIGINAL)


def patch_norm_modules(model, backend) -> int:
    """Points every known norm module of ``model`` at rms_norm; -> how many."""
    known = dict(norm_classes(import_missing=False, patchable_only=True))
    forwards, patched = {}, 0
    for module in model.modules():
        cls = type(module)
        if cls in known:
            if cls not in forwards:
                forwards[cls] = patched_norm_forward(cls, known[cls], backend)
            module.forward = types.MethodType(forwards[cls], module)
            patched += 1
    return patched


def revert_norm_modules(model) -> None:
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if hasattr(getattr(forward, "__func__", None), _ORIGINAL):
            del module.forward


def patched_norm_forward(cls, gated: bool, backend):
    original = cls.forward
    original = getattr(original, _ORIGINAL, original)

    if gated:
        @functools.wraps(original)
        def forward(self, hidden_states, gate=None):
            if _records_grad(self, hidden_states, gate):
                return original(self, hidden_states, gate)
            return tilegym_mamba2.rms_norm(hidden_states, self.weight, gate, self.variance_epsilon,
                                           getattr(self, "group_size", None), backend=backend)
    else:
        @functools.wraps(original)
        def forward(self, hidden_states):
            if _records_grad(self, hidden_states, None):
                return original(self, hidden_states)
            return tilegym_mamba2.rms_norm(hidden_states, self.weight, None, self.variance_epsilon, backend=backend)

    setattr(forward, _ORIGINAL, original)
    return forward


def _records_grad(norm, hidden_states, gate) -> bool:
    if not torch.is_grad_enabled():
        return False
    return (norm.weight.requires_grad or hidden_states.requires_grad
            or (gate is not None and gate.requires_grad))
