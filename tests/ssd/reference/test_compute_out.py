"""compute_out's reference (ssd/reference/compute_out.py) on the CPU: from the states entering each
chunk, the output is the token recurrence's; its two terms (the carried state and the chunk's own
tokens) and D's skip are each what they say."""
import torch

from tilegym_mamba2.ssd.reference.chunk_cumsum import decay_cumsum_reference
from tilegym_mamba2.ssd.reference.compute_out import chunk_output_reference
from tilegym_mamba2.ssd.reference.forward import token_recurrence
from tilegym_mamba2.ssd.reference.fwd_pass_state import chunk_states_reference

from ssd_inputs import make_inputs  # noqa: E402 (pytest puts this folder on sys.path)

L = 16


def stage_out(inputs, states=None):
    x, b, c, d, dt = (inputs[k] for k in ("x", "b", "c", "d", "dt"))
    g = decay_cumsum_reference(inputs["a"], dt, L)
    if states is None:
        states, _ = chunk_states_reference(x, b, dt, g, inputs["init_state"], L)
    return chunk_output_reference(x, b, c, d, dt, g, states, L)


def test_output_is_the_recurrence_output():
    inputs = make_inputs(2, 45, 2)
    assert torch.allclose(stage_out(inputs), token_recurrence(**inputs)[0], rtol=1e-11, atol=1e-11)


def test_the_carried_state_term_alone():
    # Zero input: the output is C read from the initial state decayed to each token (and no skip).
    inputs = make_inputs(1, 20, 1)
    inputs["x"].zero_()
    out = stage_out(inputs)
    decay = torch.exp(torch.cumsum(inputs["a"] * inputs["dt"], 1))  # [B, T, H]
    expected = torch.einsum("bhpn,btn->bthp", inputs["init_state"], inputs["c"][:, :, 0]) * decay[..., None]
    assert torch.allclose(out, expected, rtol=1e-11, atol=1e-12)


def test_d_adds_its_skip_exactly():
    inputs = make_inputs(1, 30, 1)
    with_d = stage_out(inputs)
    inputs_no_d = dict(inputs, d=torch.zeros_like(inputs["d"]))
    assert torch.allclose(with_d - stage_out(inputs_no_d), inputs["d"][:, None] * inputs["x"], rtol=1e-12, atol=1e-12)
