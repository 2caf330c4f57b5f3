"""gate_grads' reference (ssd/reference/gate_grads.py) on the CPU: the gradients through
out = (y + D x) * silu(z) against autograd, and the split of dy into its rounding and the rest."""
import torch
import torch.nn.functional as F

from tilegym_mamba2.ssd.reference.gate_grads import gate_dy_reference, gate_dz_reference


def test_dy_and_dz_are_autograd_of_the_gate():
    gen = torch.Generator().manual_seed(3)
    y, x, z, dout = (torch.randn(2, 9, 4, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    skip = torch.randn(4, dtype=torch.float64)
    y.requires_grad_(), z.requires_grad_()
    out = (y + skip[:, None] * x) * F.silu(z)
    dy_auto, dz_auto = torch.autograd.grad(out, (y, z), dout)
    dy, rest = gate_dy_reference(dout, z.detach(), torch.float64)
    assert rest is None and torch.allclose(dy, dy_auto, rtol=1e-13, atol=1e-13)
    assert torch.allclose(gate_dz_reference(dout, z.detach(), y.detach(), x, skip[:, None]), dz_auto, rtol=1e-12, atol=1e-12)


def test_a_rounded_dy_carries_what_its_rounding_left_out():
    gen = torch.Generator().manual_seed(4)
    z, dout = (torch.randn(3, 5, 2, 8, generator=gen) for _ in range(2))
    high, _ = gate_dy_reference(dout, z, torch.float32)
    dy, rest = gate_dy_reference(dout, z, torch.bfloat16)
    assert dy.dtype == torch.bfloat16 and rest is not None
    assert (dy.float() + rest.float() - high).abs().max() < (dy.float() - high).abs().max()
