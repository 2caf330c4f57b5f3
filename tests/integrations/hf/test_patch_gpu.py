"""tilegym_mamba2.transformers on a GPU: a bf16 Hugging Face Mamba-2 model patched onto our cuTile
kernels against the same model on transformers' torch path (and in fp32): logits and greedy
tokens, a decode step in a CUDA graph, a training step. Small random models built from configs;
nothing is downloaded (test_patch.py: the same on CPU)."""
import copy
import importlib.util
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tilegym_mamba2
from tilegym_mamba2.backends.base import Backend  # noqa: E402
from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402

from hf_models import (  # noqa: E402  (pytest puts this folder on sys.path)
    MODULE_NAMES, OURS, STRUCTURE_5_3, cache_tensors, expected_calls, greedy, logits, prompt, tiny_mamba2)


def on_torch_path(models, monkeypatch):
    """Run these unpatched models on transformers' torch code even where mamba_ssm or causal_conv1d
    is installed: 5.3's torch_forward; under 5.17 the module functions' own torch code (for every
    unpatched model: a patched one calls its own private bindings)."""
    if STRUCTURE_5_3:
        for model in models:
            for layer in model.backbone.layers:
                layer.mixer.forward = layer.mixer.torch_forward
        return
    packages = [p for p in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(p) is not None]
    # The training mixer's fused call too: its torch code returns None, so the mixer runs its pieces.
    for name in (*MODULE_NAMES.values(), "mamba2_split_conv1d_scan_combined"):
        torch_code = inspect.unwrap(getattr(modeling_mamba2, name))
        if torch_code.__module__ == modeling_mamba2.__name__:
            monkeypatch.setattr(modeling_mamba2, name, torch_code)
        else:  # e.g. a `kernels` layer around it: its torch code is what runs while neither package is there
            assert not packages, f"cannot reach the torch code of {name} with {packages} installed"


def gpu_pair(seed, monkeypatch):
    """(bf16 model on transformers' torch path, the same patched, the torch path in fp32)."""
    ref_model = tiny_mamba2(dtype=torch.bfloat16, device="cuda", seed=seed, hidden_size=256, num_heads=8,
                            head_dim=64, state_size=64, n_groups=1, chunk_size=64, initializer_range=0.1)
    model = copy.deepcopy(ref_model)
    apply_tilegym_kernel_to_mamba2(model=model)
    fp32_model = copy.deepcopy(ref_model).float()
    on_torch_path((ref_model, fp32_model), monkeypatch)
    return ref_model, model, fp32_model


def decode_logits(model, ids, tokens):
    """Prefill on ids, then one decode step per given token (teacher forcing); logits of each."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        steps = [out.logits[:, -1].float()]
        for k in range(tokens.shape[1]):
            out = model(tokens[:, k:k + 1], cache_params=out.cache_params, use_cache=True,
                        cache_position=torch.tensor([ids.shape[1] + k]))
            steps.append(out.logits[:, -1].float())
    return torch.stack(steps, 1)


@pytest.mark.gpu
def test_gpu_bf16_logits_and_greedy_tokens(calls, monkeypatch):
    ref_model, model, fp32_model = gpu_pair(seed=13, monkeypatch=monkeypatch)
    ids = prompt(batch=2, tokens=200, device="cuda", seed=14)
    exact = logits(fp32_model, ids)
    ours, torch_path = logits(model, ids), logits(ref_model, ids)
    scale = exact.abs().max().item()
    # bf16 everywhere: ours no further from the fp32 model than transformers' own bf16 path, give or take.
    err_ours = (ours.float() - exact).abs().max().item()
    err_torch = (torch_path.float() - exact).abs().max().item()
    assert err_ours <= 2 * err_torch + 1e-2 * scale, (err_ours, err_torch, scale)
    assert (ours.float() - torch_path.float()).abs().max().item() <= 5e-2 * scale
    assert calls.backends == {None} and calls.counts["mamba_chunk_scan_combined"] == 2

    # Decode, teacher-forced on the torch path's greedy tokens: the same bound at every step.
    ref_tokens = greedy(ref_model, ids)
    forced = ref_tokens[:, ids.shape[1]:-1]
    calls.counts.update({name: 0 for name in OURS})
    ours_steps = decode_logits(model, ids, forced)
    assert calls.counts["selective_state_update"] == 2 * forced.shape[1]
    torch_steps, exact_steps = decode_logits(ref_model, ids, forced), decode_logits(fp32_model, ids, forced)
    err_ours = (ours_steps - exact_steps).abs().amax(dim=(0, 2))
    err_torch = (torch_steps - exact_steps).abs().amax(dim=(0, 2))
    assert torch.all(err_ours <= 2 * err_torch + 1e-2 * scale), (err_ours, err_torch)

    # Greedy generation: the same tokens, unless the two bf16 paths part at a near-tie of the
    # fp32 model (random tiny models have top-2 gaps near bf16's error).
    calls.counts.update({name: 0 for name in OURS})
    tokens = greedy(model, ids)
    assert calls.counts == expected_calls(layers=2)
    new, ref_new = tokens[:, ids.shape[1]:], ref_tokens[:, ids.shape[1]:]
    if not torch.equal(new, ref_new):
        first = int((new != ref_new).any(0).nonzero()[0])
        rows = new[:, first] != ref_new[:, first]
        top2 = exact_steps[rows, first].topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]).max().item()
        band = 2 * (err_ours[first] + err_torch[first]).item()
        assert gap <= band, f"greedy tokens part at step {first} where the fp32 model's top-2 gap is {gap} > {band}"


@pytest.mark.gpu
def test_gpu_decode_step_in_a_cuda_graph(monkeypatch):
    """A whole decode step of the patched model captured in a CUDA graph and replayed against
    the same steps run eagerly. cache_position stays on the host: transformers 5.3 compares it
    with 0 in Python, which would otherwise read the GPU during capture (5.17 ignores it)."""
    _, model, _ = gpu_pair(seed=15, monkeypatch=monkeypatch)
    ids = prompt(batch=2, tokens=100, device="cuda", seed=16)
    with torch.no_grad():
        prefill = model(ids, use_cache=True)
    cache = prefill.cache_params
    start = [state.clone() for state in cache_tensors(cache)]
    first = prefill.logits[:, -1].argmax(-1, keepdim=True)

    def step(token, position):
        return model(token, cache_params=cache, use_cache=True, cache_position=position).logits

    eager, token = [], first
    with torch.no_grad():
        for k in range(4):
            out = step(token, torch.tensor([ids.shape[1] + k]))
            eager.append(out.clone())
            token = out[:, -1].argmax(-1, keepdim=True)

    def restore():  # in place: the graph reads and writes these very tensors
        for state, saved in zip(cache_tensors(cache), start, strict=True):
            state.copy_(saved)

    static_token = first.clone()
    position = torch.tensor([ids.shape[1]])  # any value > 0: the decode branch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm-up: compiles and tunes outside the capture
            restore()
            step(static_token, position)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    restore()
    with torch.cuda.graph(graph), torch.no_grad():
        static_logits = step(static_token, position)
    restore()

    token = first
    for k in range(4):
        static_token.copy_(token)
        graph.replay()
        torch.cuda.synchronize()
        # The same kernels on the same data: equal up to reduction order in cuBLAS.
        torch.testing.assert_close(static_logits, eager[k], rtol=1e-3, atol=1e-3 * eager[k].abs().max().item())
        token = static_logits[:, -1].argmax(-1, keepdim=True)
        assert torch.equal(token, eager[k][:, -1].argmax(-1, keepdim=True))


@pytest.mark.gpu
def test_gpu_bf16_training_step(monkeypatch):
    """A training step of a bf16 Mamba2 on CUDA with our scan on cuTile (in our combined call under
    5.3, in the mixer's own pieces under 5.17): every gradient within bf16 error of the same model
    in fp32 on transformers' torch path, no further from it than transformers' own bf16 torch
    path, give or take."""
    scans = []
    real = Backend.scan_combined  # every scan goes through it
    monkeypatch.setattr(Backend, "scan_combined", lambda *a, **k: scans.append(1) or real(*a, **k))
    ref_model, model, fp32_model = gpu_pair(seed=15, monkeypatch=monkeypatch)
    ids = prompt(batch=2, tokens=300, device="cuda", seed=16)
    for m in (ref_model, model, fp32_model):
        m.train()
        m(ids, labels=ids).loss.backward()
    assert len(scans) == 2
    for (name, ours), (_, theirs), (_, exact) in zip(model.named_parameters(), ref_model.named_parameters(),
                                                     fp32_model.named_parameters()):
        err_ours = ((ours.grad.float() - exact.grad).norm() / exact.grad.norm()).item()
        err_theirs = ((theirs.grad.float() - exact.grad).norm() / exact.grad.norm()).item()
        assert err_ours <= 2 * err_theirs + 2e-2, f"{name}: ours {err_ours:.2e}, transformers' bf16 {err_theirs:.2e}"
