"""transformers 5.25's extension point: a mixer's private kernel-function wrappers.

A mixer class decorated ``use_kernelized_func([...])`` (kernels >= 0.19) holds in
``mixer._kernel_funcs`` one wrapper module per kernel function, made for that instance; the
module-level names the mixer's code calls route to the calling mixer's wrapper, and ``kernelize``
plugs a Hub kernel in by setting that wrapper's ``forward``. The patch sets the same ``forward``s
to ours: only that mixer changes, and transformers' cache handling (``causal_conv1d_forward``,
``mamba2_scan_forward``) stays its own.

The mode is chosen per call, as the globals-copy structures choose their copy: a mixer in training
gets the training pieces, a call autograd records gets transformers' own, any other call ours.
A piece with no function of ours for a mode (``None``) runs transformers' own function.
"""
from __future__ import annotations

import types
import weakref

import torch

_INSTALLED = "_tilegym_mamba2_kernel_funcs"  # on a mixer: the Hooks installed on its wrappers


class Hooks:
    """The pieces for one (mixer class, flags) patch: ``inference`` and ``training`` map a
    wrapper's name to our function (or None: transformers' own). ``active`` is cleared by a
    revert of the class patch, whose mixers cannot all be found; theirs then run their own."""

    def __init__(self, inference: dict, training: dict | None):
        self.inference, self.training = inference, training
        self.active = True
        self.calls = 0  # pieces run through the hooks, whatever they ran (the first-call check)
        self.checked = False


class _Installation:
    """What a mixer's wrappers were pointed at, and for which mixer: a deep copy of the mixer
    (copy.deepcopy of a model) copies its wrappers with dispatchers of the original, which the
    copy's first call replaces (``installed`` is None for it)."""

    def __init__(self, hooks: Hooks, mixer):
        self.hooks, self.mixer = hooks, weakref.ref(mixer)


def install(mixer, hooks: Hooks) -> None:
    """Points the mixer's wrappers of ``hooks``' pieces at a dispatcher of that mixer."""
    uninstall(mixer)
    wrappers = mixer.__dict__["_kernel_funcs"]
    mixer_ref = weakref.ref(mixer)
    for name in hooks.inference:
        wrapper = wrappers[name]
        wrapper.forward = types.MethodType(_dispatcher(mixer_ref, wrapper, name, hooks), wrapper)
    mixer.__dict__[_INSTALLED] = _Installation(hooks, mixer)


def installed(mixer):
    """The active Hooks installed for this very mixer, else None."""
    installation = mixer.__dict__.get(_INSTALLED)
    if installation is None or installation.mixer() is not mixer or not installation.hooks.active:
        return None
    return installation.hooks


def copied(mixer):
    """The Hooks a deep copy of a patched mixer came with (None: none, or reverted)."""
    installation = mixer.__dict__.get(_INSTALLED)
    return installation.hooks if installation is not None and installation.hooks.active else None


def uninstall(mixer) -> None:
    installation = mixer.__dict__.pop(_INSTALLED, None)
    if installation is None:
        return
    for name in installation.hooks.inference:
        wrapper = mixer.__dict__["_kernel_funcs"][name]
        if getattr(wrapper.__dict__.get("forward"), "__func__", None) is not None:
            del wrapper.forward


def _dispatcher(mixer_ref, wrapper, name: str, hooks: Hooks):
    # transformers' own: the wrapper's class forward, called on the wrapper itself (under
    # torch.compile kernels calls this dispatcher with the module-level object as ``self``, whose
    # forward would route back here).
    def forward(_self, *args, **kwargs):
        mixer = mixer_ref()
        fn = None
        if hooks.active and mixer is not None:
            hooks.calls += 1
            if mixer.training:
                fn = None if hooks.training is None else hooks.training[name]
            elif not _records_grad(mixer, args, kwargs):
                fn = hooks.inference[name]
        if fn is None:
            return type(wrapper).forward(wrapper, *args, **kwargs)
        return fn(*args, **kwargs)

    forward.__name__ = name
    return forward


def _records_grad(mixer, args, kwargs) -> bool:
    """Whether autograd would record this call (the conv and state-update kernels have no backward)."""
    if not torch.is_grad_enabled():
        return False
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return any(t.requires_grad for t in tensors) or any(p.requires_grad for p in mixer.parameters())
