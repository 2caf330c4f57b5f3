"""Mamba2's and the hybrids' norm modules on tilegym_mamba2.rms_norm (norm_patch.py), on CPU: the pytorch
backend computes what HF's modules compute, bit for bit; a patched model calls it for every
norm outside autograd and keeps the modules' own forward where autograd records; the flag,
a second call and the revert leave no patch behind."""
import inspect

import pytest
import torch

import tilegym_mamba2

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2, revert_tilegym_kernel_to_mamba2  # noqa: E402

# unpatched_classes: autouse, every test starts and ends with the classes as shipped.
from hf_models import HYBRIDS, greedy, logits, only_5_17, prompt, tiny_hybrid, tiny_mamba2  # noqa: E402 (pytest puts this folder on sys.path)
from tilegym_mamba2.integrations.hf.norm_patch import norm_classes, same_arithmetic  # noqa: E402

# Mamba2's gated norm: MambaRMSNormGated until 5.24, Mamba2RMSNormGated from 5.25; from 5.23 it
# normalises per group and its constructor takes the group's size.
GATED = getattr(modeling, "Mamba2RMSNormGated", None) or modeling.MambaRMSNormGated


def gated_norm(width, group_size=None, **kw):
    if "group_size" in inspect.signature(GATED.__init__).parameters:
        return GATED(width, group_size=group_size or width, **kw)
    assert group_size in (None, width), "a whole-width norm before 5.23"
    return GATED(width, **kw)


@pytest.fixture
def norm_calls(monkeypatch):
    seen = []
    real = tilegym_mamba2.rms_norm

    def spy(x, weight, gate=None, eps=1e-6, group_size=None, backend=None):
        seen.append(gate is not None)
        return real(x, weight, gate, eps, group_size, backend=backend)

    monkeypatch.setattr(tilegym_mamba2, "rms_norm", spy)
    return seen


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_pytorch_backend_equals_hugging_faces_norms(dtype, weight_dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 96, generator=g) * 3).to(dtype)
    gate = torch.randn(3, 5, 130, generator=g).to(dtype)[..., 17:113]      # a strided slice, as the mixer's
    gated, plain = gated_norm(96, eps=1e-5), modeling.Mamba2RMSNorm(96, eps=1e-5)
    for norm in (gated, plain):
        norm.weight.data = torch.randn(96, generator=g).to(weight_dtype)
    with torch.no_grad():
        assert torch.equal(tilegym_mamba2.rms_norm(x, gated.weight, gate, 1e-5), gated(x, gate))
        assert torch.equal(tilegym_mamba2.rms_norm(x, plain.weight, None, 1e-5), plain(x))


@pytest.mark.skipif("group_size" not in inspect.signature(GATED.__init__).parameters,
                    reason=f"transformers {transformers.__version__}'s gated norm spans the whole width")
def test_pytorch_backend_equals_hugging_faces_per_group_norm():
    """From 5.23 the gated norm normalises each of n_groups groups on its own."""
    g = torch.Generator().manual_seed(2)
    x, gate = (torch.randn(3, 5, 96, generator=g) * 3).to(torch.bfloat16), torch.randn(3, 5, 96, generator=g)
    norm = gated_norm(96, group_size=24, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        want = norm(x, gate.to(torch.bfloat16))
        assert torch.equal(tilegym_mamba2.rms_norm(x, norm.weight, gate.to(torch.bfloat16), 1e-5, 24), want)
        assert not torch.equal(tilegym_mamba2.rms_norm(x, norm.weight, gate.to(torch.bfloat16), 1e-5), want)


def test_groups_normalise_each_group_on_its_own():
    g = torch.Generator().manual_seed(1)
    x, gate, weight = torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g), torch.randn(12, generator=g)
    got = tilegym_mamba2.rms_norm(x, weight, gate, 1e-6, group_size=4)
    for k in range(3):
        part = slice(4 * k, 4 * k + 4)
        want = tilegym_mamba2.rms_norm(x[:, part], weight[part], gate[:, part], 1e-6)
        torch.testing.assert_close(got[:, part], want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, tilegym_mamba2.rms_norm(x, weight, gate, 1e-6))


@pytest.mark.parametrize("call,match", [
    (lambda x, w: tilegym_mamba2.rms_norm(x, w[:5]), "weight must be"),
    (lambda x, w: tilegym_mamba2.rms_norm(x, w, x[:, :4]), "gate must be"),
    (lambda x, w: tilegym_mamba2.rms_norm(x, w, eps=0.0), "eps must be"),
    (lambda x, w: tilegym_mamba2.rms_norm(x, w, group_size=5), "group_size must be"),
    (lambda x, w: tilegym_mamba2.rms_norm(x.long(), w), "x must be one of"),
    (lambda x, w: tilegym_mamba2.rms_norm(x, w, backend="cutile"), "CUDA"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.randn(3, 8), torch.randn(8))


def test_a_patched_model_runs_every_norm_on_rms_norm_and_gives_the_same_tokens(norm_calls):
    ref = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=ref, rms_norm=False)     # the mixers alike: only the norms differ
    ids = prompt()
    want_logits, want_tokens = logits(ref, ids), greedy(ref, ids)
    assert norm_calls == []
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    got = logits(model, ids)
    layers = model.config.num_hidden_layers
    assert norm_calls.count(True) == layers and norm_calls.count(False) == layers + 1   # mixers; blocks + final
    assert torch.equal(got, want_logits)
    assert torch.equal(greedy(model, ids), want_tokens)


@pytest.mark.parametrize("model_type", [*sorted(HYBRIDS), pytest.param("falcon_h1", marks=only_5_17)])
def test_a_patched_hybrid_runs_its_norms_on_rms_norm_and_gives_the_same_logits(model_type, norm_calls):
    """Every call of a NORMS module goes through rms_norm (Zamba2's gated norm per group), and the
    logits are the unpatched norms' bit for bit (the pytorch backend on CPU)."""
    ref = tiny_hybrid(model_type)
    apply_tilegym_kernel_to_mamba2(model=ref, rms_norm=False)
    ids = prompt(tokens=19)
    want = logits(ref, ids)
    assert norm_calls == []
    model = tiny_hybrid(model_type)
    apply_tilegym_kernel_to_mamba2(model=model)
    patchable = {cls for cls, _ in norm_classes(import_missing=False, patchable_only=True)}
    module_calls = []
    for module in model.modules():
        if type(module) in patchable:
            module.register_forward_hook(lambda m, args, out: module_calls.append(type(m).__name__))
    got = logits(model, ids)
    assert module_calls and len(norm_calls) == len(module_calls)
    gated = sum(name.endswith("Gated") for name in module_calls)
    assert norm_calls.count(True) == gated and (gated > 0) == (model_type != "falcon_h1")  # FalconH1's is its own
    assert torch.equal(got, want)


def test_a_norm_that_rounds_otherwise_keeps_its_own_forward(monkeypatch):
    """The probe tells the listed forwards from ones that apply the weight in fp32 or ignore groups."""
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
    zamba2 = pytest.importorskip("transformers.models.zamba2.modeling_zamba2")
    assert same_arithmetic(modeling.Mamba2RMSNorm, False) and same_arithmetic(GATED, True)
    assert same_arithmetic(bamba.BambaRMSNorm, False) and same_arithmetic(zamba2.Zamba2RMSNormGated, True)

    class WeightInFp32(bamba.BambaRMSNorm):  # as transformers 5.22's NemotronHRMSNorm
        def forward(self, hidden_states):
            h = hidden_states.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.float() * h).to(hidden_states.dtype)

    class IgnoresGroups(zamba2.Zamba2RMSNormGated):  # as the gated norms before transformers 5.23
        def forward(self, hidden_states, gate=None):
            h = hidden_states.float() * torch.nn.functional.silu(gate.float())
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(hidden_states.dtype)

    assert not same_arithmetic(WeightInFp32, False)
    assert not same_arithmetic(IgnoresGroups, True)
    # A listed class whose forward changed that way (a later transformers) is left as it is.
    monkeypatch.setattr(bamba.BambaRMSNorm, "forward", WeightInFp32.forward)
    same_arithmetic.cache_clear()
    try:
        apply_tilegym_kernel_to_mamba2()
        assert bamba.BambaRMSNorm.forward is WeightInFp32.forward
        assert hasattr(bamba.BambaRMSNormGated.forward, "_tilegym_mamba2_original_norm")  # patched
        revert_tilegym_kernel_to_mamba2()
    finally:
        same_arithmetic.cache_clear()


def test_the_flag_a_second_call_and_the_revert_leave_the_norms_their_own(norm_calls):
    model = tiny_mamba2()
    ids = prompt()
    apply_tilegym_kernel_to_mamba2(model=model, rms_norm=False)
    logits(model, ids)
    assert norm_calls == []
    apply_tilegym_kernel_to_mamba2(model=model)
    apply_tilegym_kernel_to_mamba2(model=model)                     # replaces, never stacks
    logits(model, ids)
    assert len(norm_calls) == 2 * model.config.num_hidden_layers + 1
    norm_calls.clear()
    revert_tilegym_kernel_to_mamba2(model=model)
    logits(model, ids)
    assert norm_calls == []


def test_class_patch_reaches_models_built_afterwards_and_reverts(norm_calls):
    apply_tilegym_kernel_to_mamba2()
    logits(tiny_mamba2(), prompt())
    assert norm_calls
    norm_calls.clear()
    revert_tilegym_kernel_to_mamba2()
    logits(tiny_mamba2(), prompt())
    assert norm_calls == []


def test_autograd_keeps_the_modules_own_forward(norm_calls):
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    model(prompt()).logits.sum().backward()
    assert norm_calls == []
    assert model.backbone.norm_f.weight.grad is not None
