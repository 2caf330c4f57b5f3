"""How the patch plugs in on each transformers release, and what a user on another release sees:
one model patched leaves another model in the same process on transformers' own path (bit for
bit); a deep copy of a patched model runs on its own mixers; a release newer than the tested one
gets one warning naming both; a release that stops calling the kernel functions is refused at the
first call, never run on its torch path under our name; the patch's own arguments are checked
before anything is patched."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilegym_mamba2.integrations.hf import structures  # noqa: E402
from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2, revert_tilegym_kernel_to_mamba2  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402

from hf_models import OURS, STRUCTURE_5_25, greedy, logits, prompt, tiny_mamba2  # noqa: E402

only_5_25 = pytest.mark.skipif(not STRUCTURE_5_25, reason=f"transformers {transformers.__version__} has no "
                                                          f"per-mixer kernel functions")


def test_the_installed_release_is_recognised():
    structure, problem = structures.structure_of(modeling_mamba2.Mamba2Mixer)
    assert problem is None
    # 5.25's mixers are plugged in through their kernel-function wrappers, none by a globals copy.
    assert (structure.method == "kernel_funcs") == STRUCTURE_5_25


def test_patching_one_model_leaves_another_on_transformers_path(calls):
    other = tiny_mamba2(seed=3)
    ids = prompt(seed=4)
    want_logits, want_tokens = logits(other, ids), greedy(other, ids)
    patched = copy.deepcopy(other)
    apply_tilegym_kernel_to_mamba2(model=patched)
    assert torch.equal(greedy(patched, ids), want_tokens)
    assert calls.counts["selective_state_update"] > 0
    calls.counts.update({name: 0 for name in OURS})
    assert torch.equal(logits(other, ids), want_logits)       # bit for bit: transformers' own path
    assert torch.equal(greedy(other, ids), want_tokens)
    assert all(n == 0 for n in calls.counts.values()), calls.counts


def test_a_deep_copy_of_a_patched_model_runs_its_own_mixers(calls):
    model = tiny_mamba2(seed=5)
    apply_tilegym_kernel_to_mamba2(model=model)
    ids = prompt(seed=6)
    want = logits(model, ids)
    twin = copy.deepcopy(model)
    calls.counts.update({name: 0 for name in OURS})
    assert torch.allclose(logits(twin, ids), want, rtol=1e-5, atol=1e-5)
    assert calls.counts["mamba_chunk_scan_combined"] == 2
    # The copy's mode is its own: the original in training leaves the copy's inference call ours.
    model.train()
    calls.counts.update({name: 0 for name in OURS})
    logits(twin, ids)
    assert calls.counts["mamba_chunk_scan_combined"] == 2


def test_a_newer_release_gets_one_warning_naming_both(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    monkeypatch.setattr(structures, "_warned", set())
    with pytest.warns(UserWarning, match=f"transformers 5.99.0 is newer than {structures.TESTED}"):
        apply_tilegym_kernel_to_mamba2(model=tiny_mamba2())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_tilegym_kernel_to_mamba2(model=tiny_mamba2())   # once per process


def test_the_tested_release_gets_no_warning(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", f"{structures.TESTED}.0")
    monkeypatch.setattr(structures, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_tilegym_kernel_to_mamba2(model=tiny_mamba2())


@only_5_25
def test_a_forward_that_no_longer_calls_the_kernel_functions_is_refused(monkeypatch):
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    # As a later release whose mixer computes its convolution and scan without those functions.
    monkeypatch.setattr(modeling_mamba2, "causal_conv1d_forward", lambda conv1d, h, *a, **k: h)
    monkeypatch.setattr(modeling_mamba2, "mamba2_scan_forward", lambda module, h, *a, **k: h)
    with pytest.raises(RuntimeError, match=f"transformers {transformers.__version__}: Mamba2Mixer.forward ran none "
                                           f"of its kernel functions"):
        logits(model, prompt())


@only_5_25
def test_revert_of_the_class_patch_reaches_mixers_that_were_patched():
    model = tiny_mamba2()
    ids = prompt()
    want = logits(model, ids)
    apply_tilegym_kernel_to_mamba2()
    logits(model, ids)
    revert_tilegym_kernel_to_mamba2()
    assert torch.equal(logits(model, ids), want)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(model="abc"), TypeError, "model must be a torch.nn.Module .* got str"),
    (dict(model=5), TypeError, "model must be a torch.nn.Module .* got int"),
    (dict(conv1d="yes"), TypeError, "conv1d must be True or False, got 'yes'"),
    (dict(ssm=1), TypeError, "ssm must be True or False, got 1"),
    (dict(cuda_graphs=True, max_cache_len=-5), ValueError, "max_cache_len must be a positive int"),
    (dict(cuda_graphs=True, max_cache_len="x"), ValueError, "max_cache_len must be a positive int"),
    (dict(max_cache_len=64), ValueError, "max_cache_len: .* needs cuda_graphs=True"),
])
def test_bad_arguments_are_named_before_anything_is_patched(kwargs, error, match):
    with pytest.raises(error, match=match):
        apply_tilegym_kernel_to_mamba2(**kwargs)
    assert not hasattr(modeling_mamba2.Mamba2Mixer.forward, "_tilegym_mamba2_original")
