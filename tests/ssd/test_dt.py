"""ssd/dt.py: the dt the recurrence uses and its slope, which the backward multiplies by."""
import pytest
import torch

from tilegym_mamba2.core.constants import SOFTPLUS_THRESHOLD
from tilegym_mamba2.ssd.dt import process_dt, process_dt_slope


@pytest.mark.parametrize("softplus", [True, False])
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.05, 0.5)])
def test_the_slope_is_autograds(softplus, limit):
    gen = torch.Generator().manual_seed(0)
    raw = (torch.randn(2, 50, 4, generator=gen, dtype=torch.float64) * 12).requires_grad_()
    bias = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    dt = process_dt(raw, bias, softplus, limit, dtype=torch.float64)
    draw, dbias = torch.autograd.grad(dt.sum(), (raw, bias))
    slope = process_dt_slope(raw.detach(), bias.detach(), softplus, limit, dtype=torch.float64)
    assert torch.allclose(slope, draw, rtol=1e-12, atol=1e-15)
    assert torch.allclose(slope.sum((0, 1)), dbias, rtol=1e-12)


def test_softplus_passes_large_values_through_and_the_clamp_holds():
    raw = torch.tensor([[[SOFTPLUS_THRESHOLD + 1.0, -3.0, 0.0]]])
    dt = process_dt(raw, None, True, (0.1, 25.0))
    assert dt[0, 0, 0] == SOFTPLUS_THRESHOLD + 1.0
    assert dt[0, 0, 1] == 0.1  # softplus(-3) = 0.049, clamped up
    assert process_dt_slope(raw, None, True, (0.1, 25.0))[0, 0].tolist() == [1.0, 0.0, 0.5]
