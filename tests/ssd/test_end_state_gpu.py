"""A context-parallel rank's summary on the kernels (ssd/end_state.py), forward and backward,
against reference/end_state.py in float64 autograd on the same inputs."""
import pytest
import torch

from tilegym_mamba2.backends.cutile import CUTILE
from tilegym_mamba2.distributed.state_chain import slice_end_state
from tilegym_mamba2.ssd.reference.end_state import end_state_reference

CASES = [  # (batch, tokens, groups, heads, head_size, state_size, run starts, with a start state)
    (1, 1000, 1, 8, 64, 128, [0], False),
    (2, 777, 2, 8, 64, 64, [0, 300], True),
    (1, 130, 1, 4, 128, 256, [65], True),
    (2, 64, 1, 2, 32, 16, [63, 0], False),
]


def _inputs(batch, tokens, groups, heads, head_size, state_size, starts, with_start, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(tokens)

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dt)
    x, B = randn(batch, tokens, heads, head_size), randn(batch, tokens, groups, state_size, scale=0.5)
    dt = torch.rand(batch, tokens, heads, device="cuda", generator=g) * 0.2
    log_decay = -dt * (torch.rand(heads, device="cuda", generator=g) + 0.5)
    start = randn(batch, heads, head_size, state_size, dt=torch.float32) if with_start else None
    return x, B, dt, log_decay, start


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}t-{c[3]}h-{c[4]}x{c[5]}-starts{c[6]}")
def test_summary_and_its_gradients_match_float64(case):
    *shape, starts, with_start = case
    x, B, dt, log_decay, start = _inputs(*shape, starts, with_start)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, B, dt, log_decay, start)]
    state = slice_end_state(CUTILE, *leaves[:4], starts, leaves[4])
    grad = torch.randn_like(state)
    state.backward(grad)
    ref_leaves = [t.double().clone().requires_grad_() if t is not None else None for t in (x, B, dt, log_decay, start)]
    ref = end_state_reference(*ref_leaves[:4], starts, ref_leaves[4])
    ref.backward(grad.double())

    from tilegym_mamba2.testing import relative_error as rel
    assert rel(state, ref) < 1e-2, rel(state, ref)
    for name, leaf, ref_leaf in zip(("x", "B", "dt", "log_decay", "start_state"), leaves, ref_leaves):
        if leaf is None:
            continue
        assert torch.isfinite(leaf.grad).all(), name
        assert rel(leaf.grad, ref_leaf.grad) < 2e-2, (name, rel(leaf.grad, ref_leaf.grad))


@pytest.mark.gpu
def test_tokens_before_the_run_reach_nothing():
    x, B, dt, log_decay, _ = _inputs(1, 300, 1, 4, 64, 64, [100], False)
    x[:, :100], B[:, :100], dt[:, :100], log_decay[:, :100] = float("nan"), float("inf"), float("nan"), float("nan")
    leaves = [t.clone().requires_grad_() for t in (x, B, dt, log_decay)]
    state = slice_end_state(CUTILE, *leaves, [100])
    state.backward(torch.ones_like(state))
    assert torch.isfinite(state).all()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
        assert (leaf.grad[:, :100] == 0).all()
