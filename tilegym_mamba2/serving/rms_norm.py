"""The RMSNorm of a Mamba-2 block and the gated RMSNorm of its mixer, one kernel each call.

Per row of group_size values (the last dimension, or groups of it):
    h = x * silu(gate)              (gate optional)
    h = h / sqrt(mean(h^2) + eps)   (in fp32)
    out = weight * round(h, x's dtype)
The rounding before the weight is Hugging Face's (its norms return ``weight * h.to(x.dtype)``),
kept so that a patched model's activations equal its own; out's dtype is torch's promotion of
weight's and x's. In torch the two norms are 8 and 11 kernels over fp32 copies of the row: in a
2.7B-shaped model's decode step, 17 of each layer's 29 kernels. Here each is one.

Each block normalises ``rows_tile`` rows. A row of up to 4096 values is one tile, read once; a
wider one is walked in 1024-wide tiles twice, once for the sum of squares and once to scale and
store (the second read hits L2), so registers stay bounded at any width. The tile sizes,
occupancy and rows per block were chosen by timing (docs/design.md, Decisions; figures beside
torch's modules and mamba_ssm's in docs/performance.md).
"""
import cuda.tile as ct

from ..runtime.limits import CUTILE as CUTILE_LIMITS
from .validation import check_rms_norm_args, rms_norm_args
from ..core.tensors import pow2_at_least
from ..runtime import plan
from ..runtime.launch import launch, new_output

SINGLE_TILE_MAX = 4096  # the widest row read as one tile
WALK_TILE = 1024  # the tile of a wider row's two walks
MANY_ROWS = 512  # from here several rows share a block


@ct.kernel(occupancy=4)  # over twice as fast as the default on many rows (docs/design.md)
def rms_norm_kernel(x, gate, weight, out, eps: ct.Constant[float], rows_tile: ct.Constant[int],
                    width_tile: ct.Constant[int], width_tiles: ct.Constant[int], gated: ct.Constant[bool],
                    grouped: ct.Constant[bool]):
    block = ct.bid(0)
    width, groups = x.shape[1], weight.shape[0]
    # Rows are (row, group) pairs, the group fastest (the host's reshape): a block's rows may
    # take different groups' weights, gathered; with one group the weight row is one tile.
    group = (block * rows_tile + ct.arange(rows_tile, dtype=ct.int32)).reshape((rows_tile, 1)) % groups
    if width_tiles == 1:  # the row in one tile: read once
        h = _gated(x, gate, block, 0, rows_tile, width_tile, gated)
        scale = ct.rsqrt(ct.sum(h * h, axis=1, keepdims=True) / width + eps)
        _store(out, weight, h, scale, group, block, 0, rows_tile, width_tile, grouped, x.dtype)
    else:
        squares = ct.zeros((rows_tile, 1), dtype=ct.float32)
        for j in range(width_tiles):
            h = _gated(x, gate, block, j, rows_tile, width_tile, gated)
            squares = squares + ct.sum(h * h, axis=1, keepdims=True)
        scale = ct.rsqrt(squares / width + eps)
        for j in range(width_tiles):
            h = _gated(x, gate, block, j, rows_tile, width_tile, gated)
            _store(out, weight, h, scale, group, block, j, rows_tile, width_tile, grouped, x.dtype)


@ct.function
def _store(out, weight, h, scale, group, block, j, rows_tile, width_tile, grouped, x_dtype):
    if grouped:
        column = (j * width_tile + ct.arange(width_tile, dtype=ct.int32)).reshape((1, width_tile))
        w = ct.gather(weight, (group, column), padding_value=0).astype(ct.float32)
    else:
        w = ct.load(weight, (0, j), (1, width_tile), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    rounded = (h * scale).astype(x_dtype).astype(ct.float32)
    ct.store(out, (block, j), (w * rounded).astype(out.dtype))


@ct.function
def _gated(x, gate, block, j, rows_tile, width_tile, gated):
    h = ct.load(x, (block, j), (rows_tile, width_tile), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    if gated:
        g = ct.load(gate, (block, j), (rows_tile, width_tile), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
        h = h * (g / (1.0 + ct.exp(-g)))
    return h


def rms_norm(x, weight, gate=None, eps=1e-6, group_size=None):
    """Hugging Face's Mamba-2 (gated) RMSNorm on CUDA tensors; see ``tilegym_mamba2.rms_norm``.
    A repeated call (same shapes, strides, dtypes, eps, group_size) skips the checks."""
    key = plan.signature("rms_norm", x, weight, gate, eps, group_size, strides=True)
    planned = plan.planned(key)
    if planned is None:
        args = check_rms_norm_args(x, weight, gate, eps, group_size, limits=CUTILE_LIMITS)
    else:
        args = rms_norm_args(x, weight, gate, eps, group_size)
    settled = planned or launch_plan(args)
    out = run_rms_norm(args, settled)
    if planned is None:
        plan.remember(key, settled)
    return out


def launch_plan(args, width_tile=None, rows_tile=None):
    """Checked arguments -> (grid, the kernel's constants); width_tile and rows_tile override
    the measured choices (module docstring)."""
    rows, width = args.x.shape
    if width_tile is None:
        width_tile = pow2_at_least(width) if pow2_at_least(width) <= SINGLE_TILE_MAX else WALK_TILE
    if rows_tile is None:
        # Short rows: several a block, or the blocks are too short to hide their latency.
        rows_tile = 1 if rows < MANY_ROWS or width_tile == WALK_TILE else max(1, min(16, 16384 // width_tile))
    return (-(-rows // rows_tile), 1, 1), (float(args.eps), rows_tile, width_tile, -(-width // width_tile),
                                           args.gate is not None, args.weight.shape[0] > 1)


def run_rms_norm(args, settled=None):
    """Checked arguments -> out in the caller's shape; the one launch."""
    grid, constants = settled or launch_plan(args)
    out = new_output(*args.x.shape, dtype=args.out_dtype, device=args.x.device)
    launch(grid, rms_norm_kernel, (args.x, args.x if args.gate is None else args.gate, args.weight, out, *constants))
    return out.reshape(args.shape)
