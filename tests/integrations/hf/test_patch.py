"""tilegym_mamba2.transformers: Hugging Face Mamba-2 models patched onto our functions, against
the same models unpatched (transformers' torch path: neither mamba_ssm nor causal_conv1d is
installed). Small random models built from configs; nothing is downloaded."""
import copy
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tilegym_mamba2  # noqa: E402
from tilegym_mamba2.backends.base import Backend  # noqa: E402
from tilegym_mamba2.transformers import (  # noqa: E402
    apply_tilegym_kernel_to_mamba2,
    revert_tilegym_kernel_to_mamba2,
)
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer  # noqa: E402

from hf_models import (  # noqa: E402  (pytest puts this folder on sys.path)
    MODULE_NAMES, NEW_TOKENS, OURS, STRUCTURE_5_3, assert_logits_close, cache_tensors, expected_calls, greedy, logits,
    only_5_3, only_5_17, prompt, spy_on_transformers, tiny_mamba2)


def test_unpatched_model_takes_the_torch_path(monkeypatch):
    # What the CPU comparisons rely on: the unpatched model runs transformers' own torch code.
    seen = []
    if STRUCTURE_5_3:  # forward takes torch_forward on CPU tensors
        torch_forward = Mamba2Mixer.torch_forward

        def spy(self, *args, **kwargs):
            seen.append(self.layer_idx)
            return torch_forward(self, *args, **kwargs)

        monkeypatch.setattr(Mamba2Mixer, "torch_forward", spy)
    else:  # forward calls the module's scan, which falls back to its torch code without mamba_ssm
        assert importlib.util.find_spec("mamba_ssm") is None and importlib.util.find_spec("causal_conv1d") is None
        scan = getattr(modeling_mamba2, MODULE_NAMES["mamba_chunk_scan_combined"])

        def spy(*args, **kwargs):
            seen.append(args[0].shape)
            return scan(*args, **kwargs)

        monkeypatch.setattr(modeling_mamba2, MODULE_NAMES["mamba_chunk_scan_combined"], spy)
    logits(tiny_mamba2(), prompt())
    assert seen == ([0, 1] if STRUCTURE_5_3 else [(2, 37, 4, 32)] * 2)


def test_model_patch_matches_torch_path_prefill_and_decode(calls, monkeypatch):
    ref_model = tiny_mamba2()
    model = copy.deepcopy(ref_model)
    ids = prompt()
    ref_logits, ref_tokens = logits(ref_model, ids), greedy(ref_model, ids)
    assert all(n == 0 for n in calls.counts.values())

    apply_tilegym_kernel_to_mamba2(model=model)
    theirs = []  # 5.17: the module functions the patched mixer must not call
    for name in () if STRUCTURE_5_3 else MODULE_NAMES.values():
        spy_on_transformers(monkeypatch, modeling_mamba2, name, lambda *a, _name=name, _theirs=None, **k: theirs.append(_name))
    assert_logits_close(logits(model, ids), ref_logits)
    assert calls.counts["mamba_chunk_scan_combined"] == 2 and calls.counts["selective_state_update"] == 0
    calls.counts.update({name: 0 for name in OURS})

    tokens = greedy(model, ids)
    assert tokens.shape == (2, ids.shape[1] + NEW_TOKENS)
    assert torch.equal(tokens, ref_tokens)
    assert calls.counts == expected_calls(layers=2)
    assert calls.backends == {None}  # cuTile for CUDA tensors, the pytorch backend here
    assert theirs == []

    # Only this model's mixers: a model built now is untouched.
    other = tiny_mamba2()
    assert other.backbone.layers[0].mixer.forward.__func__ is Mamba2Mixer.forward


def test_decode_matches_torch_path_step_by_step(calls):
    # Each decode step's logits, not only the argmax, against the torch path's, through the cache.
    ref_model = tiny_mamba2(n_groups=1, seed=3)
    model = copy.deepcopy(ref_model)
    apply_tilegym_kernel_to_mamba2(model=model)
    ids = prompt(batch=3, tokens=21, seed=4)
    with torch.no_grad():
        ref = ref_model(ids, use_cache=True)
        out = model(ids, use_cache=True)
        assert_logits_close(out.logits, ref.logits)
        for step in range(5):
            token = ref.logits[:, -1].argmax(-1, keepdim=True)
            position = torch.tensor([ids.shape[1] + step])
            ref = ref_model(token, cache_params=ref.cache_params, use_cache=True, cache_position=position)
            out = model(token, cache_params=out.cache_params, use_cache=True, cache_position=position)
            assert_logits_close(out.logits, ref.logits)
            for ours, theirs in zip(cache_tensors(out.cache_params), cache_tensors(ref.cache_params), strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert calls.counts["selective_state_update"] == 5 * 2


def test_left_padding_masked_as_torch_path(calls):
    # A left-padded batch: transformers zeroes the padded positions' inputs in both paths.
    ref_model = tiny_mamba2(seed=5)
    model = copy.deepcopy(ref_model)
    apply_tilegym_kernel_to_mamba2(model=model)
    ids = prompt(tokens=30, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    ids[0, :9] = 0
    ref = logits(ref_model, ids, attention_mask=mask)
    assert_logits_close(logits(model, ids, attention_mask=mask), ref)
    # The mask matters: without it row 0 differs.
    assert (logits(model, ids)[0, 9:] - ref[0, 9:]).abs().max() > 1e-3
    assert torch.equal(greedy(model, ids, attention_mask=mask), greedy(ref_model, ids, attention_mask=mask))
    assert calls.counts["selective_state_update"] > 0


@only_5_17
def test_prefill_continued_on_the_cache(calls):
    # 5.17 runs a multi-token forward onto a filled cache as a prefill from the cached states: the
    # convolution over the cached inputs and the new ones, the scan from the cached state.
    ref_model = tiny_mamba2(seed=17)
    model = copy.deepcopy(ref_model)
    apply_tilegym_kernel_to_mamba2(model=model)
    ids = prompt(tokens=40, seed=18)
    first, rest = ids[:, :23], ids[:, 23:]
    with torch.no_grad():
        ref, out = ref_model(first, use_cache=True), model(first, use_cache=True)
        ref = ref_model(rest, cache_params=ref.cache_params, use_cache=True)
        out = model(rest, cache_params=out.cache_params, use_cache=True)
    assert_logits_close(out.logits, ref.logits)
    assert_logits_close(out.logits, logits(ref_model, ids)[:, 23:])  # the cache carried the first part
    for ours, theirs in zip(cache_tensors(out.cache_params), cache_tensors(ref.cache_params), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert calls.counts["mamba_chunk_scan_combined"] == 2 * 2 and calls.counts["selective_state_update"] == 0


@only_5_17
def test_forward_decorator_is_kept(calls):
    # 5.17 wraps forward to fire the accelerate hook of conv1d, whose weights the kernels read
    # directly (offloading); the patched forward runs inside the same wrapper.
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    events = []

    class Hook:
        def pre_forward(self, module):
            events.append(("pre", module))

        def post_forward(self, module, output):
            events.append(("post", module))

    convs = [layer.mixer.conv1d for layer in model.backbone.layers]
    for conv in convs:
        conv._hf_hook = Hook()
    logits(model, prompt())
    assert events == [(when, conv) for conv in convs for when in ("pre", "post")]
    assert calls.counts["mamba_chunk_scan_combined"] == 2


def test_class_patch_covers_models_built_before_and_after(calls):
    before = tiny_mamba2(seed=7)
    reference = copy.deepcopy(before)
    ids = prompt(seed=8)
    ref_logits, ref_tokens = logits(reference, ids), greedy(reference, ids)

    apply_tilegym_kernel_to_mamba2()
    after = transformers.Mamba2ForCausalLM(before.config).eval()
    after.load_state_dict(before.state_dict())
    for model in (before, after):
        calls.counts.update({name: 0 for name in OURS})
        assert_logits_close(logits(model, ids), ref_logits)
        assert torch.equal(greedy(model, ids), ref_tokens)
        assert calls.counts["causal_conv1d_fn"] == 2 + 2 and calls.counts["selective_state_update"] == 22

    revert_tilegym_kernel_to_mamba2()
    calls.counts.update({name: 0 for name in OURS})
    assert torch.equal(greedy(after, ids), ref_tokens)
    assert all(n == 0 for n in calls.counts.values())


def test_patching_twice_does_not_stack(calls):
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2()
    apply_tilegym_kernel_to_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    apply_tilegym_kernel_to_mamba2(model=model)
    original = Mamba2Mixer.forward._tilegym_mamba2_original
    assert original.__qualname__ == "Mamba2Mixer.forward" and not hasattr(original, "_tilegym_mamba2_original")
    assert model.backbone.layers[0].mixer.forward.__func__._tilegym_mamba2_original is original
    logits(model, prompt())
    assert calls.counts["mamba_chunk_scan_combined"] == 2  # once per layer

    revert_tilegym_kernel_to_mamba2(model=model)
    assert "forward" not in model.backbone.layers[0].mixer.__dict__
    revert_tilegym_kernel_to_mamba2()
    assert Mamba2Mixer.forward is original


def test_flags_choose_the_pieces(calls, monkeypatch):
    ref_model = tiny_mamba2(seed=9)
    ids = prompt(seed=10)
    ref_tokens = greedy(ref_model, ids)
    pieces = {"conv1d": ("causal_conv1d_fn", "causal_conv1d_update"),
              "ssm": ("mamba_chunk_scan_combined", "selective_state_update")}
    if STRUCTURE_5_3:
        # What transformers 5.3 finds without mamba_ssm and causal_conv1d (set here too, for
        # machines that have them): a piece left out then runs our pytorch backend.
        with monkeypatch.context() as names:
            for name in OURS:
                names.setattr(modeling_mamba2, MODULE_NAMES[name], None)
            for left_out in pieces:
                model = copy.deepcopy(ref_model)
                apply_tilegym_kernel_to_mamba2(**{left_out: False}, model=model)
                calls.counts.update({name: 0 for name in OURS})
                calls.backends.clear()
                assert torch.equal(greedy(model, ids), ref_tokens)
                assert calls.counts == expected_calls(layers=2)
                assert calls.backends == {None, "pytorch"}

    # Where transformers has a function for a piece (5.3: the package is installed; 5.17: always,
    # with its torch code as the fallback), a piece left out calls that, and ours only the other.
    found = []
    for name in OURS:
        def installed(*args, _name=name, _theirs=None, **kwargs):
            found.append(_name)
            if _theirs is None:  # 5.3 without the package: stand in with our pytorch backend
                return calls.real[_name](*args, backend="pytorch", **kwargs)
            return _theirs(*args, **kwargs)

        spy_on_transformers(monkeypatch, modeling_mamba2, MODULE_NAMES[name], installed)
    expected = expected_calls(layers=2)
    for left_out, names in pieces.items():
        model = copy.deepcopy(ref_model)
        apply_tilegym_kernel_to_mamba2(**{left_out: False}, model=model)
        found.clear()
        calls.counts.update({name: 0 for name in OURS})
        assert torch.equal(greedy(model, ids), ref_tokens)
        assert sorted(found) == sorted(name for name in names for _ in range(expected[name]))
        assert calls.counts == {name: 0 if name in names else expected[name] for name in OURS}


def test_use_cutile_asks_for_the_cutile_backend(monkeypatch):
    class Reached(Exception):
        pass

    seen = []

    def record(*args, backend="absent", **kwargs):
        seen.append(backend)
        raise Reached

    for name in OURS + ("rms_norm",):
        monkeypatch.setattr(tilegym_mamba2, name, record)
    model = tiny_mamba2()
    with pytest.raises(ValueError, match="use_cutile: the cuTile kernels take CUDA tensors, and model's parameters "
                                         "are on cpu"):
        apply_tilegym_kernel_to_mamba2(model=model, use_cutile=True)   # refused before anything is patched
    assert "forward" not in vars(model.backbone.layers[0].mixer)
    apply_tilegym_kernel_to_mamba2(use_cutile=True)                    # the classes: no device to check
    with pytest.raises(Reached):
        logits(model, prompt())
    assert seen == ["cutile"]


def test_autograd_outside_training_keeps_transformers_forward(calls):
    # (A training-mode mixer runs on ours: test_training_runs_on_our_scan.)
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    ids = prompt()
    out = model(ids).logits  # eval mode, autograd on: our serving kernels are forward-only
    out.sum().backward()
    assert model.backbone.layers[0].mixer.in_proj.weight.grad is not None
    # Frozen weights, but a gradient wanted for the inputs.
    model.requires_grad_(False)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    model(inputs_embeds=embeds).logits.sum().backward()
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0
    assert all(n == 0 for n in calls.counts.values())
    logits(model, ids)
    assert calls.counts["mamba_chunk_scan_combined"] == 2


@pytest.mark.parametrize("n_groups", [1, 2])
def test_training_runs_on_our_scan(n_groups, monkeypatch):
    """A training-mode Mamba2 runs each mixer on our scan: under 5.3 in our combined call (one
    group only: with two, 5.3's mixer, which cannot decline the fused call, keeps its own
    forward), under 5.17 in the mixer's own pieces. The loss and every parameter's gradient are
    transformers' torch path's."""
    scans, combined = [], []
    # Every scan, direct or inside the combined call, goes through a Backend object's scan_combined.
    for module, name, seen in ((Backend, "scan_combined", scans),
                               (tilegym_mamba2, "mamba_split_conv1d_scan_combined", combined)):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _seen=seen, **k: _seen.append(1) or _real(*a, **k))
    ids = prompt()
    model = tiny_mamba2(n_groups=n_groups).train()
    reference = copy.deepcopy(model)
    apply_tilegym_kernel_to_mamba2(model=model)
    loss = model(ids, labels=ids).loss
    loss.backward()
    reference_loss = reference(ids, labels=ids).loss
    reference_loss.backward()
    layers = model.config.num_hidden_layers
    if STRUCTURE_5_3:
        expected = (layers, layers) if n_groups == 1 else (0, 0)
    else:
        expected = (layers, 0)
    assert (len(scans), len(combined)) == expected
    assert torch.allclose(loss, reference_loss, rtol=1e-5, atol=1e-6)
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        assert ours.grad is not None and theirs.grad is not None, name
        err = ((ours.grad - theirs.grad).norm() / theirs.grad.norm().clamp_min(1e-30)).item()
        assert err < 1e-4, f"{name}: {err:.2e}"


def test_model_without_a_mixer_is_refused():
    with pytest.raises(ValueError, match="model: Linear has no Mamba-2 mixer"):
        apply_tilegym_kernel_to_mamba2(model=torch.nn.Linear(2, 2))


def test_unexpected_mixer_structure_names_the_version(monkeypatch):
    # A mixer in neither structure: no cuda_kernels_forward, and a forward that calls no kernel.
    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return self.out_proj(hidden_states)

    monkeypatch.delattr(Mamba2Mixer, "cuda_kernels_forward", raising=False)
    monkeypatch.setattr(Mamba2Mixer, "forward", forward)
    message = (f"transformers {transformers.__version__}: Mamba2Mixer has no cuda_kernels_forward method .*"
               f"forward calls none of causal_conv1d_fn, causal_conv1d_update, mamba2_selective_state_update")
    with pytest.raises(RuntimeError, match=message):
        apply_tilegym_kernel_to_mamba2()
    with pytest.raises(RuntimeError, match=message):
        apply_tilegym_kernel_to_mamba2(model=tiny_mamba2())


def test_mixer_calling_some_kernels_is_refused(monkeypatch):
    # The structure's method calls the convolution but neither scan: refused, naming the scans.
    def partial(self, hidden_states, cache_params=None, cache_position=None, attention_mask=None, **kwargs):
        return causal_conv1d_update(causal_conv1d_fn(hidden_states))  # noqa: F821 (names only: never called)

    monkeypatch.setattr(Mamba2Mixer, "cuda_kernels_forward" if STRUCTURE_5_3 else "forward", partial)
    scans = ", ".join(MODULE_NAMES[name] for name in ("selective_state_update", "mamba_chunk_scan_combined"))
    with pytest.raises(RuntimeError, match=f"transformers {transformers.__version__}: Mamba2Mixer.* no longer calls "
                                           f"{scans}, mamba2?_split_conv1d_scan_combined"):
        apply_tilegym_kernel_to_mamba2()


@only_5_3
def test_changed_forward_signature_is_refused(monkeypatch):
    # 5.3's patch runs cuda_kernels_forward with forward's arguments: the two must agree.
    def forward(self, hidden_states, attention_mask=None):
        raise AssertionError("not called")

    monkeypatch.setattr(Mamba2Mixer, "forward", forward)
    with pytest.raises(RuntimeError, match="Mamba2Mixer.forward takes"):
        apply_tilegym_kernel_to_mamba2()
