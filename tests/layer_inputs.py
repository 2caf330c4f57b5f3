"""Small float64 layer-op inputs for the CPU tests of the backward and of autograd."""
import torch

F64 = torch.float64


def layer_inputs(seed, batch, tokens, groups=2, heads=4, state=8, head=6, d_per_channel=False, z=True,
                 bias=True, init=None, sequences=None):
    g = torch.Generator().manual_seed(seed)
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)
    t = dict(x=randn(batch, tokens, heads, head), dt=0.5 * randn(batch, tokens, heads),
             A=-0.5 - 2 * torch.rand(heads, generator=g, dtype=F64),
             B=randn(batch, tokens, groups, state), C=randn(batch, tokens, groups, state),
             D=randn(heads, head) if d_per_channel else randn(heads))
    if z:
        t["z"] = randn(batch, tokens, heads, head)
    if bias:
        t["dt_bias"] = randn(heads)
    if init == "row":
        t["initial_states"] = randn(batch, heads, head, state)
    elif init == "sequence":
        t["initial_states"] = randn(sequences, heads, head, state)
    return t


def cu(*ends):
    return torch.tensor((0,) + ends)
