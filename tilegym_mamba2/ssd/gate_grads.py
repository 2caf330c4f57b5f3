"""The output gate's gradients, out = (y + D x) * silu(z), in one pass each.

With g = sigmoid(z), for the gradient dout of out:
    dy = dout * z * g                                   what the scans' backward takes
    dz = dout * (y + D x) * g * (1 + z (1 - g))
in fp32 from 16-bit tensors. dy goes to the scans' matmuls in x's dtype, split into two terms
(its rounding and what the rounding left out), as reference/gate_grads.py's gate_dy_reference.
In torch these are about twenty passes over fp32 copies of [batch, tokens, heads, head_size],
more than half of a layer's training step; here two kernels read each input once and write each
result once (docs/design.md, Decisions).

The kernels see [batch, tokens, heads, head_size] as a matrix of tokens by channels (heads ×
head_size, a view where the strides allow it): a block takes a tile of tokens and of channels, so
D, one value per channel, is one row loaded once per block (a gather per element from a row index
that mixed heads ran at a quarter of the memory bandwidth).
"""
import cuda.tile as ct
import torch

from ..core.tensors import pow2_at_least
from ..runtime.launch import launch, new_output

# Tiles of 16384 elements, up to 1024 channels wide: dz 0.355 -> 0.212 ms and dy 0.264 -> 0.187 ms
# on the 2.7B layer's training step (H200) against 4096 and 256, ~3.2-3.6 TB/s.
ELEMENTS_PER_BLOCK = 16384
CHANNELS_TILE_MAX = 1024


@ct.function
def _load(t, tokens_tile, channels_tile):
    return ct.load(t, (ct.bid(0), ct.bid(1)), (tokens_tile, channels_tile),
                   padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)


@ct.kernel
def gate_dy_kernel(dout, z, dy_high, dy_low, tokens_tile: ct.Constant[int], channels_tile: ct.Constant[int],
                   split: ct.Constant[bool]):
    zf = _load(z, tokens_tile, channels_tile)
    dy = _load(dout, tokens_tile, channels_tile) * zf / (1.0 + ct.exp(-zf))
    high = dy.astype(dy_high.dtype)
    ct.store(dy_high, (ct.bid(0), ct.bid(1)), high)
    if split:
        ct.store(dy_low, (ct.bid(0), ct.bid(1)), (dy - high.astype(ct.float32)).astype(dy_low.dtype))


@ct.kernel
def gate_dz_kernel(dout, z, y, x, skip, dz, tokens_tile: ct.Constant[int], channels_tile: ct.Constant[int],
                   has_skip: ct.Constant[bool]):
    zf = _load(z, tokens_tile, channels_tile)
    gate = 1.0 / (1.0 + ct.exp(-zf))
    pre = _load(y, tokens_tile, channels_tile)
    if has_skip:
        d = ct.load(skip, (0, ct.bid(1)), (1, channels_tile), padding_mode=ct.PaddingMode.ZERO)
        pre = pre + d * _load(x, tokens_tile, channels_tile)
    grad = _load(dout, tokens_tile, channels_tile) * pre * gate * (1.0 + zf * (1.0 - gate))
    ct.store(dz, (ct.bid(0), ct.bid(1)), grad.astype(dz.dtype))


def _channels(t):
    """[batch, tokens, heads, head_size] -> [batch * tokens, heads * head_size]: a view where the
    strides allow it (z sliced out of a mixer's projection does), else a copy."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])


def _tiles(tokens, channels):
    channels_tile = min(CHANNELS_TILE_MAX, pow2_at_least(channels))
    tokens_tile = max(1, ELEMENTS_PER_BLOCK // channels_tile)
    return (-(-tokens // tokens_tile), -(-channels // channels_tile), 1), tokens_tile, channels_tile


def gate_dy(dout, z, dtype):
    """-> (dy in ``dtype``, what that rounding left out in ``dtype`` or None when dtype is fp32)."""
    zc = _channels(z)
    grid, tokens_tile, channels_tile = _tiles(*zc.shape)
    split = dtype != torch.float32
    high = new_output(*zc.shape, dtype=dtype, device=z.device)
    low = new_output(*zc.shape, dtype=dtype, device=z.device) if split else high
    launch(grid, gate_dy_kernel, (_channels(dout), zc, high, low, tokens_tile, channels_tile, split))
    return high.reshape(z.shape), (low.reshape(z.shape) if split else None)


def gate_dz(dout, z, y, x, skip):
    """-> dz in z's dtype; skip [heads, 1] or [heads, head_size] fp32, or None."""
    heads, width = z.shape[2], z.shape[3]
    zc = _channels(z)
    grid, tokens_tile, channels_tile = _tiles(*zc.shape)
    dz = new_output(*zc.shape, dtype=z.dtype, device=z.device)
    d = zc if skip is None else skip.to(torch.float32).expand(heads, width).reshape(1, heads * width)
    launch(grid, gate_dz_kernel, (_channels(dout), zc, _channels(y), _channels(x), d, dz, tokens_tile,
                                  channels_tile, skip is not None))
    return dz.reshape(z.shape)
