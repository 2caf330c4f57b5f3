"""Small tensor helpers and constants shared by the kernels, the references, the backward and the
backends."""
import torch

from .constants import LOG_DECAY_FLOOR


def log_decay(a: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """a * dt with the recurrence's limits: 0 where dt = 0 (no time passes, whatever a; -inf * 0
    would be NaN) and at least LOG_DECAY_FLOOR (exp of it is 0). A NaN stays NaN."""
    product = torch.where(dt == 0, torch.zeros((), dtype=dt.dtype, device=dt.device), a * dt)
    return torch.where(product < LOG_DECAY_FLOOR, torch.full((), LOG_DECAY_FLOOR, dtype=product.dtype,
                                                             device=product.device), product)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): tile sizes, tuning buckets."""
    return 1 << max(0, (n - 1).bit_length())


def compute_dtype(*tensors) -> torch.dtype:
    """The dtype the PyTorch paths compute in: float64 when any input is float64, else float32."""
    for t in tensors:  # a loop, not any(generator): no Python frame per tensor
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def expand_groups(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, tokens, groups, n] -> [batch, tokens, heads, n]: head h reads group h // (heads // groups).
    A view where there is one group or one group per head."""
    groups = bc.shape[2]
    if groups == heads:
        return bc
    if groups == 1:
        return bc.expand(-1, -1, heads, -1)
    return bc.repeat_interleave(heads // groups, dim=2)


def group_sums(per_head: torch.Tensor, groups: int, dtype=torch.float32) -> torch.Tensor:
    """[batch, tokens, heads (or blocks of a group's heads), n] -> [batch, tokens, groups, n],
    summed in ``dtype``: the gradient of a group's B or C is the sum over the heads that read it."""
    batch, tokens, heads, n = per_head.shape
    if heads == groups:
        return per_head.to(dtype)
    return per_head.view(batch, tokens, groups, heads // groups, n).sum(3, dtype=dtype)
