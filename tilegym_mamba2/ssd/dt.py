"""The dt the recurrence uses, from the raw dt of the layer op (dt_bias, softplus, dt_limit), and its
slope for the backward. Plain torch, shared by every backend and the backward's algorithm."""
import torch
import torch.nn.functional as F

from ..core.constants import NO_LIMIT, SOFTPLUS_THRESHOLD


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=NO_LIMIT, dtype=torch.float32):
    """Raw dt [batch, tokens, heads] -> the dt the recurrence uses."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt, threshold=SOFTPLUS_THRESHOLD)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def process_dt_slope(dt, dt_bias=None, dt_softplus=False, dt_limit=NO_LIMIT, dtype=torch.float32):
    """d process_dt / d dt, elementwise (also d / d dt_bias): softplus's sigmoid below its
    threshold, 1 above it, 0 where the clamp holds dt at a limit (torch.clamp's rule)."""
    pre = dt.to(dtype)
    if dt_bias is not None:
        pre = pre + dt_bias.to(dtype)
    slope = torch.ones_like(pre)
    if dt_softplus:
        slope = torch.where(pre > SOFTPLUS_THRESHOLD, slope, torch.sigmoid(pre))
        pre = F.softplus(pre, threshold=SOFTPLUS_THRESHOLD)
    return slope * ((pre >= dt_limit[0]) & (pre <= dt_limit[1]))
