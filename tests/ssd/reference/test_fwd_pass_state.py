"""fwd_pass_state's reference (ssd/reference/fwd_pass_state.py) on the CPU: the state entering each
chunk is the token recurrence's state at that chunk's start."""
import pytest
import torch

from tilegym_mamba2.ssd.reference.chunk_cumsum import decay_cumsum_reference
from tilegym_mamba2.ssd.reference.forward import token_recurrence
from tilegym_mamba2.ssd.reference.fwd_pass_state import chunk_states_reference

from ssd_inputs import make_inputs  # noqa: E402 (pytest puts this folder on sys.path)


@pytest.mark.parametrize("with_init", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
def test_entry_states_are_the_recurrence_states_at_chunk_starts(with_init, groups):
    L, tokens = 16, 53
    inputs = make_inputs(2, tokens, groups, with_init=with_init)
    g = decay_cumsum_reference(inputs["a"], inputs["dt"], L)
    states, final = chunk_states_reference(inputs["x"], inputs["b"], inputs["dt"], g, inputs["init_state"], L)
    assert states.shape == (2, 4, 4, 8, 16)
    for k in range(4):
        if k == 0:
            expected = inputs["init_state"] if with_init else torch.zeros_like(states[:, :, 0])
        else:
            prefix = dict(inputs, **{name: inputs[name][:, :k * L] for name in ("x", "b", "c", "dt")})
            expected = token_recurrence(**prefix)[1]
        assert torch.allclose(states[:, :, k], expected, rtol=1e-11, atol=1e-11), k
    assert torch.allclose(final, token_recurrence(**inputs)[1], rtol=1e-11, atol=1e-11)


def test_a_chunk_without_input_only_decays_the_state():
    inputs = make_inputs(1, 32, 1)
    inputs["x"][:, 16:] = 0
    g = decay_cumsum_reference(inputs["a"], inputs["dt"], 16)
    states, final = chunk_states_reference(inputs["x"], inputs["b"], inputs["dt"], g, inputs["init_state"], 16)
    decay = torch.exp(inputs["a"] * inputs["dt"][:, 16:].sum(1))  # [B, H]
    assert torch.allclose(final, decay[..., None, None] * states[:, :, 1], rtol=1e-12, atol=1e-14)
