"""Repeated calls on a GPU (skipped elsewhere): planned calls give the first call's bits, and the
ops capture into a CUDA graph whose replay gives the eager bits, with the plan settled before the
capture or not."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.runtime import plan
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs

pytestmark = pytest.mark.gpu

SHAPES = [(1, 2048, 1, 32, 128, 64), (2, 300, 2, 8, 64, 32), (1, 40, 1, 4, 128, 64)]


def inputs_for(shape, init):
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda", seed=5)
    kw = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    if not init:
        kw["init_state"] = None
    return kw


def layer_kw(kw):
    heads = kw["x"].shape[2]
    gen = torch.Generator(device="cuda").manual_seed(3)
    return dict(x=kw["x"], dt=kw["dt"], A=kw["a"], B=kw["b"], C=kw["c"], chunk_size=256, D=kw["d"],
                z=torch.randn(kw["x"].shape, device="cuda", generator=gen).to(kw["x"].dtype),
                dt_bias=torch.randn(heads, device="cuda", generator=gen), dt_softplus=True,
                return_final_states=True)


def captured(call, warm: bool):
    """(graph, its outputs); with ``warm`` the call ran (and settled its plan) before the capture."""
    if warm:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    return graph, outputs


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("init", [False, True], ids=["no init", "init"])
def test_planned_calls_give_the_first_calls_bits(shape, init):
    kw = inputs_for(shape, init)
    plan.forget()
    first = tilegym_mamba2.mamba2_chunk_forward(**kw)
    for _ in range(2):
        again = tilegym_mamba2.mamba2_chunk_forward(**kw)
        assert all(torch.equal(f, a) for f, a in zip(first, again))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("warm", [True, False], ids=["plan settled", "first call captured"])
@pytest.mark.parametrize("op", ["forward", "layer"])
def test_graph_replay_gives_the_eager_bits(shape, warm, op, monkeypatch):
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "0")  # the eager call and the captured one: one config
    kw = inputs_for(shape, init=op == "forward")
    if op == "forward":
        def call():
            return tilegym_mamba2.mamba2_chunk_forward(**kw)
    else:
        lkw = layer_kw(kw)

        def call():
            return tilegym_mamba2.mamba_chunk_scan_combined(**lkw)
    plan.forget()
    eager = [t.clone() for t in call()]
    plan.forget()
    graph, outputs = captured(call, warm)
    for t in outputs:
        t.fill_(float("nan"))  # whatever the capture left there must be rewritten by the replay
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(e, o) for e, o in zip(eager, outputs))
    kw["x"].mul_(0.5)  # new inputs in the same buffers: the replay follows them
    kw["dt"].mul_(0.5)
    graph.replay()
    fresh = call()
    torch.cuda.synchronize()
    assert all(torch.equal(f, o) for f, o in zip(fresh, outputs))
