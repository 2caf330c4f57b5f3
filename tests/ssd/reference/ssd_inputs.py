"""Float64 inputs of the plain op for the reference stages' tests."""
import torch
import torch.nn.functional as F


def make_inputs(batch, tokens, groups, heads=4, head_size=8, state_size=16, with_init=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    return dict(
        x=randn(batch, tokens, heads, head_size),
        a=-(1 + 15 * torch.rand(heads, generator=gen, dtype=torch.float64)),
        b=randn(batch, tokens, groups, state_size),
        c=randn(batch, tokens, groups, state_size),
        d=randn(heads),
        dt=F.softplus(randn(batch, tokens, heads) - 2),
        init_state=randn(batch, heads, head_size, state_size) if with_init else None,
    )
