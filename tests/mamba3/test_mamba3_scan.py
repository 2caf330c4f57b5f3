"""Mamba-3's definition and its registered op, on the CPU (float64 references; no kernels yet)."""
import math

import pytest
import torch

import tilegym
import tilegym_mamba2  # noqa: F401 (registers the ops)
from tilegym_mamba2.mamba3.reference import rotate_pairs, token_recurrence
from tilegym_mamba2.mamba3.scan import mamba3_scan_pytorch
from tilegym_mamba2.ssd.reference.forward import token_recurrence as mamba2_token_recurrence
from tilegym_mamba2.testing import MAMBA3_ARGS, Mamba3ProblemSpec, relative_error

TOLERANCE = 1e-5  # the fp32 op against the float64 definition


def sample(**fields):
    spec = dict(batch_size=2, num_tokens=9, num_groups=2, num_heads=4, state_size=8, head_size=3)
    return Mamba3ProblemSpec(**{**spec, **fields}).get_sample_inputs()


def call(inputs):
    return {k: inputs[k] for k in MAMBA3_ARGS}


def test_euler_rule_without_rotation_is_mamba2():
    s = sample(trapezoid=False, rotary=False)
    out, final = token_recurrence(**call(s))
    out2, final2 = mamba2_token_recurrence(s["x"], s["A"], s["B"], s["C"], s["D"], s["dt"], s["initial_state"])
    assert torch.allclose(out, out2, rtol=1e-12, atol=1e-12) and torch.allclose(final, final2, rtol=1e-12, atol=1e-12)


def test_trapezoid_mixes_the_previous_and_this_token_input():
    # Two tokens, one head, written out by hand.
    x = torch.tensor([[[[1.0]], [[2.0]]]], dtype=torch.float64)  # [1, 2, 1, 1]
    b = torch.tensor([[[[1.0]], [[3.0]]]], dtype=torch.float64)
    c = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    dt = torch.tensor([[[0.5], [0.25]]], dtype=torch.float64)
    a = torch.tensor([-2.0], dtype=torch.float64)
    trap = torch.tensor([[[0.3], [0.6]]], dtype=torch.float64)
    out, final = token_recurrence(x, dt, a, b, c, trap=trap)
    h1 = 0.3 * 0.5 * 1.0 * 1.0  # no previous input at the first token
    alpha2 = math.exp(-2.0 * 0.25)
    h2 = alpha2 * h1 + (1 - 0.6) * 0.25 * alpha2 * (1.0 * 1.0) + 0.6 * 0.25 * (2.0 * 3.0)
    assert out[0, :, 0, 0].tolist() == pytest.approx([h1, h2], rel=1e-12)
    assert final.item() == pytest.approx(h2, rel=1e-12)


def test_rotation_is_a_complex_diagonal_state():
    # The same scan with the state's pairs as complex numbers rotating by dt * angles per token.
    s = sample(num_groups=4, trapezoid=False)
    out, final = token_recurrence(**call(s), dtype=torch.float64)
    f64 = torch.float64
    x, dt, a, d = s["x"].to(f64), s["dt"].to(f64), s["A"].to(f64), s["D"].to(f64)
    b = torch.view_as_complex(s["B"].to(f64).unflatten(-1, (-1, 2)).contiguous())  # [B, T, H, N/2]
    c = torch.view_as_complex(s["C"].to(f64).unflatten(-1, (-1, 2)).contiguous())
    angles = s["angles"].to(f64)
    # The initial state is real in the rotated frame: start the complex state from it.
    init = s["initial_state"].to(f64)
    z = torch.view_as_complex(init.unflatten(-1, (-1, 2)).contiguous())  # [B, H, P, N/2]
    phase = torch.zeros_like(angles[:, 0])
    ys = []
    for t in range(x.shape[1]):
        step = dt[:, t]
        phase = phase + step[..., None] * angles[:, t]
        turn = torch.exp(torch.complex(torch.zeros_like(phase), -step[..., None] * angles[:, t]))
        z = torch.exp(a * step)[..., None, None] * turn[:, :, None] * z \
            + step[..., None, None] * x[:, t, :, :, None] * b[:, t, :, None, :]
        ys.append((c[:, t, :, None, :].conj() * z).real.sum(-1) + d[:, None] * x[:, t])
    assert torch.allclose(out, torch.stack(ys, 1), rtol=1e-10, atol=1e-10)
    # The state leaves in the frame of the last token's phase.
    turned = torch.view_as_real(z * torch.exp(torch.complex(torch.zeros_like(phase), phase))[:, :, None]).flatten(-2)
    assert torch.allclose(final, turned, rtol=1e-10, atol=1e-10)


def test_rank_one_mimo_is_the_single_input_scan():
    s = sample(rank=1)
    siso = {**call(s), "x": s["x"][:, :, :, 0], "B": s["B"][:, :, :, 0], "C": s["C"][:, :, :, 0]}
    out, final = token_recurrence(**call(s))
    out1, final1 = token_recurrence(**siso)
    assert torch.equal(out[:, :, :, 0], out1) and torch.equal(final, final1)


def test_mimo_ranks_add_into_one_state():
    s = sample(rank=3)
    _, final = token_recurrence(**{**call(s), "D": None})
    parts = sum(token_recurrence(**{**call(s), "D": None, "initial_state": None, "trap": None,
                                    "x": s["x"][:, :, :, r:r + 1], "B": s["B"][:, :, :, r:r + 1],
                                    "C": s["C"][:, :, :, r:r + 1]})[1] for r in range(3))
    _, final_plain = token_recurrence(**{**call(s), "D": None, "initial_state": None, "trap": None})
    assert torch.allclose(final_plain, parts, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(final, final_plain)  # the trapezoid and the initial state do count


def test_rotate_pairs_keeps_lengths_and_inverts():
    t = torch.randn(5, 8, dtype=torch.float64)
    phase = torch.randn(5, 4, dtype=torch.float64)
    turned = rotate_pairs(t, phase)
    assert torch.allclose(turned.unflatten(-1, (4, 2)).norm(dim=-1), t.unflatten(-1, (4, 2)).norm(dim=-1))
    assert torch.allclose(rotate_pairs(turned, -phase), t)


@pytest.mark.parametrize("fields", [dict(), dict(rank=2), dict(dtype=torch.bfloat16), dict(trapezoid=False, rotary=False)])
def test_the_registered_op_meets_the_definition(fields):
    s = sample(**fields)
    out, final = tilegym.ops.mamba3_scan(**call(s))
    assert out.dtype == s["x"].dtype and out.shape == s["x"].shape and final.dtype == torch.float32
    tolerance = 1e-2 if s["x"].dtype == torch.bfloat16 else TOLERANCE
    assert relative_error(out, s["out"]) < tolerance and relative_error(final, s["final_state"]) < tolerance


def test_the_op_differentiates():
    s = sample(num_tokens=4)
    x = s["x"].to(torch.float64).requires_grad_()
    out, final = mamba3_scan_pytorch(**{**call(s), "x": x})
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("change, fault", [
    (lambda s: {**s, "dt": s["dt"][:, :-1]}, "dt must be"),
    (lambda s: {**s, "C": s["C"][..., :-2]}, "C must have B's shape"),
    (lambda s: {**s, "angles": s["angles"][..., :-1]}, "angles must be"),
    (lambda s: {**s, "trap": s["trap"].to(torch.int32)}, "trap must be a floating-point"),
    (lambda s: {**s, "A": s["A"][:1]}, "A must be"),
    (lambda s: {**s, "initial_state": s["initial_state"][0]}, "initial_state must be"),
    (lambda s: {**s, "x": s["x"][..., 0]}, "x must be"),
    (lambda s: {**s, "x": s["x"].unsqueeze(3)}, "B must be .batch, tokens, groups, rank, state_size"),
    (lambda s: {**s, "D": "one"}, "D must be a torch.Tensor"),
])
def test_bad_arguments_name_the_one_at_fault(change, fault):
    with pytest.raises((TypeError, ValueError), match=fault):
        mamba3_scan_pytorch(**change(call(sample())))


def test_spec_refuses_what_the_op_cannot_take():
    with pytest.raises(ValueError, match="state_size must be even"):
        Mamba3ProblemSpec(1, 4, 1, 1, 7, 2)
    with pytest.raises(ValueError, match="num_heads"):
        Mamba3ProblemSpec(1, 4, 2, 3, 8, 2)
