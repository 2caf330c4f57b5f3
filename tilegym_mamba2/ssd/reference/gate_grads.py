"""gate_grads' reference: the gradients through the output gate out = (y + D x) * silu(z)
(ssd/gate_grads.py computes the same)."""
import torch


def gate_dy_reference(dout, z, dtype):
    """The gradient reaching y through out = (y + D x) * silu(z): dy = dout z sigmoid(z), computed
    in fp32 (fp64 for fp64) -> (dy rounded to ``dtype``, what the rounding left out in ``dtype``,
    or None when ``dtype`` is the computing dtype). The scans' matmuls take dy in x's dtype: the
    rounded dy alone moved the mixer's dA 1.5e-3 off float64 against mamba_ssm's 4.7e-4, so the
    rest goes along as a second term (backward.py)."""
    acc = torch.promote_types(dtype, torch.float32)
    zf = z.to(acc)
    dy = dout.to(acc) * zf * torch.sigmoid(zf)
    high = dy.to(dtype)
    return high, (None if dtype == acc else (dy - high.to(acc)).to(dtype))


def gate_dz_reference(dout, z, y, x, skip):
    """dz of out = (y + skip x) * silu(z) in z's dtype; y without the skip, skip [heads, 1] or
    [heads, head_size] in the computing dtype, or None."""
    acc = torch.promote_types(z.dtype, torch.float32)
    zf = z.to(acc)
    gate = torch.sigmoid(zf)
    pre_gate = y.to(acc) if skip is None else y.to(acc) + skip * x.to(acc)
    return (dout.to(acc) * pre_gate * gate * (1 + zf * (1 - gate))).to(z.dtype)
