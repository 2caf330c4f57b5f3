"""The chunked reference agrees with the token recurrence, stage by stage."""

import math

import pytest
import torch
import torch.nn.functional as F

from tilegym_mamba2.backends.pytorch import mamba2_chunk_forward_pytorch
from tilegym_mamba2.ssd.reference.forward import (
    LOG2E,
    chunk_output_reference,
    chunk_states_reference,
    chunked_forward_reference,
    decay_cumsum_reference,
    token_recurrence,
)
from tilegym_mamba2.testing import relative_error as rel_err

from ssd_inputs import make_inputs  # noqa: E402 (pytest puts this folder on sys.path)


SHAPES = [
    # batch, tokens, groups, chunk_size, with_init
    (1, 1, 1, 16, False),
    (1, 1, 2, 128, True),
    (2, 7, 4, 16, True),
    (1, 32, 1, 32, False),
    (2, 64, 2, 16, True),
    (1, 100, 1, 32, True),
    (2, 100, 2, 64, False),
    (1, 100, 4, 256, True),
    (2, 128, 1, 128, True),
    (1, 200, 2, 128, False),
    (1, 256, 4, 64, True),
    (2, 300, 1, 256, True),
]


@pytest.mark.parametrize("batch,tokens,groups,chunk_size,with_init", SHAPES)
def test_chunked_matches_token_recurrence(batch, tokens, groups, chunk_size, with_init):
    inputs = make_inputs(batch, tokens, groups, with_init=with_init)
    out_ref, final_ref = token_recurrence(**inputs)
    out, final = chunked_forward_reference(**inputs, chunk_size=chunk_size)
    assert out_ref.dtype == out.dtype == final.dtype == torch.float64
    assert out.shape == inputs["x"].shape
    assert final.shape == final_ref.shape == (batch, 4, 8, 16)
    assert rel_err(out, out_ref) < 1e-10
    assert rel_err(final, final_ref) < 1e-10


def test_token_recurrence_single_step_by_hand():
    inputs = make_inputs(1, 1, 1, heads=1, head_size=1, state_size=1)
    x, a, b, c, d, dt, h0 = (inputs[k].item() for k in ("x", "a", "b", "c", "d", "dt", "init_state"))
    h1 = math.exp(a * dt) * h0 + dt * x * b
    out, final = token_recurrence(**inputs)
    assert final.item() == pytest.approx(h1, rel=1e-12)
    assert out.item() == pytest.approx(h1 * c + d * x, rel=1e-12)


def test_groups_map_to_consecutive_heads():
    # With 4 heads in 2 groups, heads 0-1 read group 0: making group 1 zero
    # must zero the state of heads 2-3 only.
    inputs = make_inputs(1, 10, 2, with_init=False)
    inputs["b"][:, :, 1] = 0
    _, final = token_recurrence(**inputs)
    assert final[:, 2:].abs().max() == 0
    assert final[:, :2].abs().min() > 0


@pytest.mark.parametrize("tokens,chunk_size", [(100, 32), (64, 16), (1, 16)])
def test_stage_shapes_and_invariants(tokens, chunk_size):
    inputs = make_inputs(2, tokens, 2)
    x, a, b, c, d, dt, init = (inputs[k] for k in ("x", "a", "b", "c", "d", "dt", "init_state"))
    num_chunks = -(-tokens // chunk_size)

    g = decay_cumsum_reference(a, dt, chunk_size)
    assert g.shape == (2, 4, num_chunks * chunk_size)
    # Flat after the last real token: padding adds no decay.
    assert torch.equal(g[:, :, tokens:], g[:, :, tokens - 1 : tokens].expand_as(g[:, :, tokens:]))
    # Restarts at each chunk, natural cumsum scaled by log2(e), non-increasing within a chunk.
    first = g[:, :, ::chunk_size]
    expected_first = (a * dt[:, ::chunk_size]).transpose(1, 2) * LOG2E
    assert rel_err(first, expected_first) < 1e-14
    assert (g.view(2, 4, num_chunks, chunk_size).diff(dim=-1) <= 0).all()

    states, final = chunk_states_reference(x, b, dt, g, init, chunk_size)
    assert states.shape == (2, 4, num_chunks, 8, 16)
    assert final.shape == (2, 4, 8, 16)
    assert torch.equal(states[:, :, 0], init)

    out = chunk_output_reference(x, b, c, d, dt, g, states, chunk_size)
    assert out.shape == x.shape
    out_ref, final_ref = token_recurrence(**inputs)
    assert rel_err(out, out_ref) < 1e-10
    assert rel_err(final, final_ref) < 1e-10


def test_chunk_states_are_recurrence_states_at_chunk_boundaries():
    inputs = make_inputs(1, 96, 1)
    g = decay_cumsum_reference(inputs["a"], inputs["dt"], 32)
    states, _ = chunk_states_reference(inputs["x"], inputs["b"], inputs["dt"], g, inputs["init_state"], 32)
    prefix = dict(inputs, **{k: inputs[k][:, :32] for k in ("x", "b", "c", "dt")})
    _, after_first_chunk = token_recurrence(**prefix)
    assert rel_err(states[:, :, 1], after_first_chunk) < 1e-10


def test_none_init_state_equals_zeros():
    inputs = make_inputs(1, 50, 1, with_init=False)
    out_none, final_none = chunked_forward_reference(**inputs, chunk_size=16)
    inputs["init_state"] = torch.zeros(1, 4, 8, 16, dtype=torch.float64)
    out_zero, final_zero = chunked_forward_reference(**inputs, chunk_size=16)
    assert torch.equal(out_none, out_zero)
    assert torch.equal(final_none, final_zero)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pytorch_backend_close_to_float64(dtype):
    inputs = make_inputs(2, 200, 2, heads=4, head_size=16, state_size=32)
    # Quantize the low-precision inputs first so the comparison isolates the
    # float32 arithmetic, not the input rounding.
    for k in ("x", "b", "c"):
        inputs[k] = F.silu(inputs[k]).to(dtype)
    inputs["dt"] = inputs["dt"].to(dtype)
    for k in ("a", "d", "init_state"):
        inputs[k] = inputs[k].float()
    out, final = mamba2_chunk_forward_pytorch(**inputs, chunk_size=64)
    assert out.dtype == dtype
    assert final.dtype == torch.float32
    out_ref, final_ref = token_recurrence(**inputs)
    tol = {torch.bfloat16: 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    assert rel_err(out, out_ref) < tol
    assert rel_err(final, final_ref) < 1e-5


def test_float32_reference_returns_float32():
    inputs = make_inputs(1, 40, 1)
    out, final = chunked_forward_reference(**inputs, chunk_size=16, dtype=torch.float32)
    assert out.dtype == final.dtype == torch.float32
    out_ref, final_ref = token_recurrence(**inputs)
    assert rel_err(out, out_ref) < 1e-5
    assert rel_err(final, final_ref) < 1e-5


def test_strong_decay_gives_no_nan_or_inf():
    # Large |a| * dt makes in-chunk exponents huge; masking must keep them finite.
    inputs = make_inputs(1, 64, 1)
    inputs["a"] = torch.full((4,), -200.0, dtype=torch.float64)
    inputs["dt"] = torch.full_like(inputs["dt"], 5.0)
    out, final = mamba2_chunk_forward_pytorch(**{k: v.float() for k, v in inputs.items()}, chunk_size=64)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    out_ref, _ = token_recurrence(**inputs)
    assert rel_err(out, out_ref) < 1e-5
