"""chunk_cumsum's reference (ssd/reference/chunk_cumsum.py) on the CPU: base-2 in-chunk sums of a * dt."""
import math

import pytest
import torch

from tilegym_mamba2.ssd.reference.chunk_cumsum import decay_cumsum_reference

from ssd_inputs import make_inputs  # noqa: E402 (pytest puts this folder on sys.path)


@pytest.mark.parametrize("tokens,chunk_size", [(1, 16), (70, 32), (64, 16)])
def test_sums_restart_each_chunk_in_base_two(tokens, chunk_size):
    inputs = make_inputs(2, tokens, 1)
    a, dt = inputs["a"], inputs["dt"]
    g = decay_cumsum_reference(a, dt, chunk_size)
    chunks = -(-tokens // chunk_size)
    assert g.shape == (2, 4, chunks * chunk_size)
    for start in range(0, tokens, chunk_size):
        stop = min(start + chunk_size, tokens)
        natural = torch.cumsum(a * dt[:, start:stop], dim=1).transpose(1, 2)  # [B, H, tokens of the chunk]
        assert torch.allclose(g[:, :, start:stop], natural / math.log(2), rtol=1e-13, atol=1e-13)


def test_two_to_the_sum_is_the_decay_product():
    inputs = make_inputs(1, 20, 1)
    g = decay_cumsum_reference(inputs["a"], inputs["dt"], 32)
    product = torch.cumprod(torch.exp(inputs["a"] * inputs["dt"]), dim=1).transpose(1, 2)
    assert torch.allclose(torch.exp2(g[:, :, :20]), product, rtol=1e-12)


def test_padded_tokens_add_no_decay():
    inputs = make_inputs(1, 40, 1)
    g = decay_cumsum_reference(inputs["a"], inputs["dt"], 32)
    assert torch.equal(g[:, :, 40:], g[:, :, 39:40].expand(-1, -1, 24))
