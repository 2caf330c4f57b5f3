"""The expert layers' capture-safe path (integrations/hf/experts.py) on the CPU: while a capture is
under way (stood in for here) each expert layer of transformers' MoE hybrids gives its eager output
with no host read, and a whole model's greedy tokens stay transformers' own."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilegym_mamba2.integrations.hf import experts as experts_module  # noqa: E402
from tilegym_mamba2.integrations.hf.decode_graphs import DecodeGraphs, check_graphable  # noqa: E402
from tilegym_mamba2.integrations.hf.experts import (capture_safe_experts, eager_experts, expert_layers,  # noqa: E402
                                                    routed_experts)
from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2  # noqa: E402

from hf_models import MOE_HYBRIDS  # noqa: E402
from hf_models import tiny_hybrid as hybrid  # noqa: E402
from test_hybrid_decode_graphs import generate, left_padded, with_runner  # noqa: E402


@pytest.fixture
def capturing(monkeypatch):
    """torch.cuda.is_current_stream_capturing() answers True, and a host read raises, naming itself."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"a host read ({name}) in the capture-safe expert path")
        return read
    return lambda: [monkeypatch.setattr(torch.Tensor, name, refuse(name)) for name in ("item", "tolist", "nonzero")]


@pytest.mark.parametrize("model_type", sorted(MOE_HYBRIDS))
@pytest.mark.parametrize("tokens", [1, 2, 7])
@pytest.mark.parametrize("gather_cost", [1, 3])  # 4 experts, top 2: at cost 1 one or two tokens gather
def test_each_expert_layer_gives_its_eager_output(model_type, tokens, gather_cost, capturing, monkeypatch):
    """Each MoE block (its router runs too), eager, then with its experts on the capture-safe path."""
    monkeypatch.setattr(experts_module, "GATHER_COST", gather_cost)
    model = hybrid(model_type)
    assert expert_layers(model), f"no expert layer found in {model_type}"
    for ours, theirs in eager_then_capture_safe(model, torch.randn(1, tokens, model.config.hidden_size), capturing):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (model_type, tokens)


def eager_then_capture_safe(model, x, capturing):
    """[(capture-safe output, eager output)] of each MoE block of ``model`` on ``x``."""
    blocks = [_block_of(model, module) for module, _ in expert_layers(model)]
    with torch.no_grad():
        want = [block(x) for block in blocks]
    capture_safe_experts(model)
    capturing()
    with torch.no_grad():
        got = [block(x) for block in blocks]
    return list(zip(got, want))


def _block_of(model, module):
    """The MoE block whose forward routes to ``module`` (the module itself for 5.3's GraniteMoeHybridMoE)."""
    for candidate in model.modules():
        if getattr(candidate, "experts", None) is module:
            return candidate
    return module


def test_routed_experts_gather_and_dense_agree_with_a_loop():
    gen = torch.Generator().manual_seed(0)
    experts, width, hidden = 15, 8, 6
    up, down = torch.randn(experts, 2 * hidden, width, generator=gen), torch.randn(experts, width, hidden, generator=gen)

    def activate(h):
        gate, lin = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * lin

    for tokens in (1, 2, 9):  # 2 pairs per token: gathers while 3 * tokens * 2 <= 15
        x = torch.randn(tokens, width, generator=gen)
        index = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=gen)
        want = torch.stack([sum(weights[t, k] * (down[index[t, k]] @ activate(up[index[t, k]] @ x[t]))
                                for k in range(2)) for t in range(tokens)])
        assert torch.allclose(routed_experts(x, index, weights, up, down, activate), want, rtol=1e-5, atol=1e-5)
        transposed = routed_experts(x, index, weights, up.transpose(1, 2), down.transpose(1, 2), activate,
                                    transposed=True)
        assert torch.allclose(transposed, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(MOE_HYBRIDS))
@pytest.mark.parametrize("gather_cost", [1, 3])  # at 1 the batch of one gathers its two experts
def test_tokens_with_the_capture_safe_experts_are_transformers_own(model_type, gather_cost, monkeypatch):
    """The static-cache decode step (run without a graph) with every expert layer on its capture-safe
    path: batches of 1, 5 and 13 left-padded prompts give transformers' greedy tokens."""
    monkeypatch.setattr(experts_module, "GATHER_COST", gather_cost)
    reference = hybrid(model_type)
    model = copy.deepcopy(reference)
    apply_tilegym_kernel_to_mamba2(model=model)
    check_graphable(model, graphs=True)  # expert layers of a known layout: not refused
    assert capture_safe_experts(model) > 0
    runner = DecodeGraphs(model, (1, 8, 16), use_graphs=False)
    calls = []
    routed = experts_module.routed_experts
    monkeypatch.setattr(experts_module, "routed_experts", lambda *a, **k: calls.append(1) or routed(*a, **k))
    for batch in (1, 5, 13):
        ids, mask = left_padded(batch, "cpu", seed=batch)
        want = generate(reference, ids, mask)
        with monkeypatch.context() as capture:
            capture.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            got = with_runner(model, runner, ids, mask)
        assert torch.equal(got, want), f"{model_type}, batch {batch}"
    assert calls, "the capture-safe path never ran"


def test_the_eager_forward_comes_back():
    model = hybrid("granitemoehybrid")
    layers = expert_layers(model)
    before = [module.forward for module, _ in layers]
    assert capture_safe_experts(model) == capture_safe_experts(model) == len(layers)  # idempotent
    assert all(module.forward.__func__ is forward for module, forward in layers)
    eager_experts(model)
    assert [module.forward for module, _ in layers] == before


def test_an_expert_layer_of_another_layout_is_refused_by_name():
    class StrangeMoE(torch.nn.Module):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), StrangeMoE())
    with pytest.raises(ValueError, match="1: StrangeMoE is an expert layer of a layout the decode graphs do not know"):
        expert_layers(model)
    assert experts_module.expert_layers(torch.nn.Linear(2, 2)) == []


@pytest.mark.parametrize("model_type", sorted(MOE_HYBRIDS))
def test_router_ties_pick_the_experts_transformers_picks(model_type, capturing):
    """A router whose logits all tie (its weights zeroed): the capture-safe path routes with the same
    top-k call on the same logits, so ties go to the experts transformers' own forward picks."""
    model = hybrid(model_type)
    for name, parameter in model.named_parameters():
        if "router" in name or name.endswith("gate.weight"):
            with torch.no_grad():
                parameter.zero_()
    for ours, theirs in eager_then_capture_safe(model, torch.randn(1, 3, model.config.hidden_size), capturing):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
