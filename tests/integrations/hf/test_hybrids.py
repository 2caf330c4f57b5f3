"""The hybrids (Bamba, GraniteMoeHybrid, NemotronH, Zamba2, FalconH1) patched onto our functions,
against their unpatched selves on transformers' torch path; tiny random models on a CPU."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tilegym_mamba2  # noqa: E402,F401 (registers the ops)
from tilegym_mamba2.backends.base import Backend  # noqa: E402
from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2  # noqa: E402

from hf_models import (  # noqa: E402  (pytest puts this folder on sys.path)
    FALCON_H1, HYBRIDS, HYBRIDS_5_17, OURS, PROMPT_BATCH, STRUCTURE_5_3, assert_logits_close, expected_calls,
    greedy, logits, only_5_3, only_5_17, prompt)


@pytest.mark.parametrize("model_type", [*sorted(HYBRIDS), *(pytest.param(m, marks=only_5_17) for m in HYBRIDS_5_17)])
def test_hybrid_models_match_their_torch_path(model_type, calls):
    torch.manual_seed(11)
    config = (HYBRIDS | HYBRIDS_5_17)[model_type]()
    ref_model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = copy.deepcopy(ref_model)
    ids = prompt(batch=PROMPT_BATCH.get(model_type, 2), seed=12)
    ref_logits, ref_tokens = logits(ref_model, ids), greedy(ref_model, ids)
    assert all(n == 0 for n in calls.counts.values())

    apply_tilegym_kernel_to_mamba2(model=model)
    assert_logits_close(logits(model, ids), ref_logits)
    calls.counts.update({name: 0 for name in OURS})
    assert torch.equal(greedy(model, ids), ref_tokens)
    assert calls.counts == expected_calls(layers=2)


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_hybrid_models_train_on_our_scan(model_type, monkeypatch):
    """The hybrids' mixers with one group, in training mode: every mixer runs our scan (in the
    combined call, or in the prefill pieces where a mixer skips that call, as nemotron_h and
    zamba2 do when they are given a cache); the loss is transformers' torch path's, and every
    gradient is that of the patched model in float64 (our pytorch backend, exact in float64)."""
    scans = []
    real = Backend.scan_combined  # every scan goes through it
    monkeypatch.setattr(Backend, "scan_combined", lambda *a, **k: scans.append(1) or real(*a, **k))
    config = HYBRIDS[model_type]()
    for name in ("mamba_n_groups", "mamba_ngroups", "n_groups"):
        if hasattr(config, name):
            setattr(config, name, 1)
    torch.manual_seed(11)
    reference = transformers.AutoModelForCausalLM.from_config(config).train()
    for module in reference.modules():
        # nemotron_h's and zamba2's torch paths clamp dt at time_step_min, their kernel paths (and
        # ours) at dt_limit: 0 makes the clamp a no-op, so that both compute the same function.
        if hasattr(module, "time_step_min"):
            module.time_step_min = 0.0
    model = copy.deepcopy(reference)
    apply_tilegym_kernel_to_mamba2(model=model)
    # Not transformers' torch path in float64: nemotron_h's and zamba2's run their scan in fp32.
    # 5.17's granitemoehybrid experts use grouped_mm, which has no float64: fp32 again there.
    exact = copy.deepcopy(model)
    if STRUCTURE_5_3 or model_type != "granitemoehybrid":
        exact = exact.double()
    ids = prompt(seed=12)
    losses = [m(ids, labels=ids).loss for m in (model, reference, exact)]
    for loss in losses:
        loss.backward()
    assert len(scans) == 4  # two mixers, in fp32 and in float64
    assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    # And transformers' own gradients, but for the decay's (dt_bias, A_log: ~1e-8 in this model)
    # where the torch path runs its scan in fp32.
    fp32_scan = model_type in ("nemotron_h", "zamba2")
    for (name, ours), (_, theirs), (_, want) in zip(model.named_parameters(), reference.named_parameters(),
                                                    exact.named_parameters()):
        assert (ours.grad is None) == (theirs.grad is None) == (want.grad is None), name
        if want.grad is None:
            continue
        err = ((ours.grad.double() - want.grad).norm() / want.grad.norm().clamp_min(1e-30)).item()
        assert err < 1e-4, f"{name}: {err:.2e}"
        if not (fp32_scan and name.endswith(("dt_bias", "A_log"))):
            err = ((ours.grad - theirs.grad).norm() / theirs.grad.norm().clamp_min(1e-30)).item()
            assert err < 1e-3, f"{name} against transformers': {err:.2e}"


@only_5_3
def test_falcon_h1_left_alone_under_5_3():
    # 5.3's FalconH1Mixer.cuda_kernels_forward enters torch.cuda.device: not checked on a CPU, so not patched.
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer

    apply_tilegym_kernel_to_mamba2()
    assert not hasattr(FalconH1Mixer.forward, "_tilegym_mamba2_original")
    with pytest.raises(ValueError, match="FalconH1ForCausalLM has no Mamba-2 mixer"):
        apply_tilegym_kernel_to_mamba2(model=transformers.AutoModelForCausalLM.from_config(FALCON_H1()))
