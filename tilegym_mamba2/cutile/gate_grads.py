"""The output gate's gradients, out = (y + D x) * silu(z), in one pass each.

With g = sigmoid(z), for the gradient dout of out:
    dy = dout * z * g                                   what the scans' backward takes
    dz = dout * (y + D x) * g * (1 + z (1 - g))
in fp32 from 16-bit tensors. dy goes to the scans' matmuls in x's dtype, split into two terms
(its rounding and what the rounding left out), as reference/layer.py's gate_dy_reference.
In torch these are about twenty passes over fp32 copies of [batch, tokens, heads, head_size],
more than half of a layer's training step; here two kernels read each input once and write each
result once (docs/design.md, Decisions).

Rows are (batch, token, head) triples, head fastest; a block takes ``rows_tile`` of them and
the whole head_size (a power-of-two tile, padded); D [heads, head_size] is gathered per row.
"""
import cuda.tile as ct
import torch

from ..core.tensors import pow2_at_least
from .launch import launch, new_output

ELEMENTS_PER_BLOCK = 4096


@ct.function
def _load(t, block, rows_tile, width_tile):
    return ct.load(t, (block, 0), (rows_tile, width_tile), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)


@ct.kernel
def gate_dy_kernel(dout, z, dy_high, dy_low, rows_tile: ct.Constant[int], width_tile: ct.Constant[int],
                   split: ct.Constant[bool]):
    block = ct.bid(0)
    zf = _load(z, block, rows_tile, width_tile)
    dy = _load(dout, block, rows_tile, width_tile) * zf / (1.0 + ct.exp(-zf))
    high = dy.astype(dy_high.dtype)
    ct.store(dy_high, (block, 0), high)
    if split:
        ct.store(dy_low, (block, 0), (dy - high.astype(ct.float32)).astype(dy_low.dtype))


@ct.kernel
def gate_dz_kernel(dout, z, y, x, skip, dz, heads: int, rows_tile: ct.Constant[int], width_tile: ct.Constant[int],
                   has_skip: ct.Constant[bool]):
    block = ct.bid(0)
    zf = _load(z, block, rows_tile, width_tile)
    gate = 1.0 / (1.0 + ct.exp(-zf))
    pre = _load(y, block, rows_tile, width_tile)
    if has_skip:
        head = (block * rows_tile + ct.arange(rows_tile, dtype=ct.int32)).reshape((rows_tile, 1)) % heads
        column = ct.arange(width_tile, dtype=ct.int32).reshape((1, width_tile))
        d = ct.gather(skip, (head, column), padding_value=0)
        pre = pre + d * _load(x, block, rows_tile, width_tile)
    grad = _load(dout, block, rows_tile, width_tile) * pre * gate * (1.0 + zf * (1.0 - gate))
    ct.store(dz, (block, 0), grad.astype(dz.dtype))


def _rows(t):
    """[batch, tokens, heads, head_size] -> [rows, head_size], copied only when not dense."""
    return t.reshape(-1, t.shape[-1]) if t.is_contiguous() else t.contiguous().reshape(-1, t.shape[-1])


def _tiles(rows, width):
    width_tile = pow2_at_least(width)
    rows_tile = max(1, min(128, ELEMENTS_PER_BLOCK // width_tile))
    return (-(-rows // rows_tile), 1, 1), rows_tile, width_tile


def gate_dy(dout, z, dtype):
    """-> (dy in ``dtype``, what that rounding left out in ``dtype`` or None when dtype is fp32)."""
    shape = z.shape
    d, zr = _rows(dout), _rows(z)
    grid, rows_tile, width_tile = _tiles(*zr.shape)
    split = dtype != torch.float32
    high = new_output(*zr.shape, dtype=dtype, device=z.device)
    low = new_output(*zr.shape, dtype=dtype, device=z.device) if split else high
    launch(grid, gate_dy_kernel, (d, zr, high, low, rows_tile, width_tile, split))
    return high.reshape(shape), (low.reshape(shape) if split else None)


def gate_dz(dout, z, y, x, skip):
    """-> dz in z's dtype; skip [heads, 1] or [heads, head_size] fp32, or None."""
    shape, heads, width = z.shape, z.shape[2], z.shape[3]
    zr = _rows(z)
    grid, rows_tile, width_tile = _tiles(*zr.shape)
    dz = new_output(*zr.shape, dtype=z.dtype, device=z.device)
    d = zr if skip is None else skip.to(torch.float32).expand(heads, width).contiguous()
    launch(grid, gate_dz_kernel, (_rows(dout), zr, _rows(y), _rows(x), d, dz, heads, rows_tile, width_tile,
                                  skip is not None))
    return dz.reshape(shape)
