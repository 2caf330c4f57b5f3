"""The causal convolution's decode step (causal_conv1d's causal_conv1d_update).

The inputs a step sees are the conv_state's last width - 1 entries followed by the new tokens x;
    out[i] = act(bias + sum_w weight[w] u[i + w]),   u = (history, x)
and conv_state [slots, dim, state_len] is updated in place: without cache_seqlens it rolls (it
becomes the last state_len entries of (conv_state, x)); with cache_seqlens it is a circular
buffer: the history is the width - 1 entries before position p = cache_seqlens % state_len and
x is written from p on (when x is longer than the buffer, its last entries win).

Each block handles dim_tile channels of one batch row: it reads that row's whole state into
registers before writing any of it, so the roll needs no second buffer. With conv_state_indices
a row uses conv_state[indices[row]]; a negative index is a padding row (out 0, no state read or
written).
"""
import cuda.tile as ct

from ..runtime.limits import CUTILE as CUTILE_LIMITS
from .validation import check_conv_update_args, conv_update_args
from ..core.tensors import pow2_at_least
from ..runtime import plan
from ..runtime.launch import launch, new_output


# Occupancy 8 and 128-channel blocks: a block's work is a few dependent
# loads, so what counts is how many are in flight (docs/design.md, Decisions).
@ct.kernel(occupancy=8)
def causal_conv1d_update_kernel(x, conv_state, weight, bias, cache_seqlens, indices, out,
                                width: ct.Constant[int], token_tile: ct.Constant[int], dim_tile: ct.Constant[int],
                                state_tile: ct.Constant[int], has_bias: ct.Constant[bool],
                                circular: ct.Constant[bool], has_indices: ct.Constant[bool], silu: ct.Constant[bool]):
    row, dim_block = ct.bid(0), ct.bid(1)
    if has_indices:
        slot = ct.gather(indices, row)
        # A negative index is a padding row; so is one past the last slot: nothing out of bounds
        # is read or written (indices live on the device, so the host checks cannot see them).
        if (slot >= 0) & (slot < conv_state.shape[0]):
            _step(x, conv_state, weight, bias, cache_seqlens, out, row, slot, dim_block, width, token_tile,
                  dim_tile, state_tile, has_bias, circular, silu)
        else:
            ct.store(out, (row, dim_block, 0), ct.zeros((1, dim_tile, token_tile), dtype=out.dtype))
    else:
        _step(x, conv_state, weight, bias, cache_seqlens, out, row, row, dim_block, width, token_tile, dim_tile,
              state_tile, has_bias, circular, silu)


@ct.function
def _step(x, conv_state, weight, bias, cache_seqlens, out, row, slot, dim_block, width, token_tile, dim_tile,
          state_tile, has_bias, circular, silu):
    tokens, state_len = x.shape[2], conv_state.shape[2]
    channel = (dim_block * dim_tile + ct.arange(dim_tile, dtype=ct.int32)).reshape((dim_tile, 1))
    i = ct.arange(token_tile, dtype=ct.int32).reshape((1, token_tile))            # output token
    j = ct.arange(state_tile, dtype=ct.int32).reshape((1, state_tile))            # state position
    x_tile = ct.load(x, (row, dim_block, 0), (1, dim_tile, token_tile),
                     padding_mode=ct.PaddingMode.ZERO).reshape((dim_tile, token_tile))
    old = ct.load(conv_state, (slot, dim_block, 0), (1, dim_tile, state_tile),
                  padding_mode=ct.PaddingMode.ZERO).reshape((dim_tile, state_tile))
    if circular:
        position = ct.gather(cache_seqlens, row).astype(ct.int32) % state_len
        position = ct.where(position < 0, position + state_len, position)
    else:
        position = state_len

    # u[k] for k = i + w: history entry k (k < width - 1) or x[k - (width - 1)]. Both come from the
    # register tiles old and x_tile, selected by a one-hot sum (exact: one term is non-zero).
    acc = ct.zeros((dim_tile, token_tile), dtype=ct.float32)
    for w in ct.static_iter(range(width)):
        k = i + w
        history_at = (position + state_len - (width - 1) + k) % state_len          # [1, token_tile], >= 0 before %
        from_history = _select(old, history_at, j, state_tile, token_tile)
        from_x = _select(x_tile, k - (width - 1), i, token_tile, token_tile)
        u = ct.where(k < width - 1, from_history, from_x)
        tap = ct.gather(weight, (channel, w)).astype(ct.float32)                   # [dim_tile, 1]
        acc = acc + tap * u
    if has_bias:
        acc = acc + ct.gather(bias, channel).astype(ct.float32)
    if silu:
        acc = acc / (1.0 + ct.exp(-acc))
    ct.store(out, (row, dim_block, 0), acc.astype(out.dtype).reshape((1, dim_tile, token_tile)))

    if circular:
        # Position p takes x[r + m * state_len] for the largest such index < tokens, r = (p - position) mod state_len.
        r = (j - position + state_len) % state_len
        source = r + ((tokens - 1 - r) // state_len) * state_len
        new = ct.where(r < tokens, _select(x_tile, source, i, token_tile, state_tile).astype(conv_state.dtype),
                       old)
    else:
        # new[p] = (old, x)[p + tokens]
        shifted = j + tokens
        new = ct.where(shifted < state_len,
                       _select(old.astype(ct.float32), shifted, j, state_tile, state_tile),
                       _select(x_tile.astype(ct.float32), shifted - state_len, i, token_tile, state_tile))
        new = new.astype(conv_state.dtype)
    ct.store(conv_state, (slot, dim_block, 0), new.reshape((1, dim_tile, state_tile)))


@ct.function
def _select(values, at, positions, size, count):
    """values [dim_tile, size], at [1, count] -> [dim_tile, count]: values[:, at] (0 where at is
    outside 0..size-1), as a one-hot sum over the register tile."""
    hit = positions.reshape((1, size, 1)) == at.reshape((1, 1, count))              # [1, size, count]
    spread = ct.where(hit, values.astype(ct.float32).reshape((values.shape[0], size, 1)), 0.0)
    return ct.sum(spread, axis=1)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """causal_conv1d's causal_conv1d_update on CUDA tensors: conv_state updated in place, returns
    out like x (x's dtype). A repeated call (the same shapes, strides, dtypes, devices and
    activation) skips the checks: its plan (plan.py) holds the launch's grid and constants."""
    key = plan.signature("causal_conv1d_update", x, conv_state, weight, bias, activation, cache_seqlens,
                         conv_state_indices, strides=True)
    planned = plan.planned(key)
    if planned is None:
        args = check_conv_update_args(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices,
                                      limits=CUTILE_LIMITS)
    else:
        args = conv_update_args(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
    settled = planned or launch_plan(args)
    out = run_conv_update(args, settled)
    if planned is None:
        plan.remember(key, settled)  # after the launch, as the forward: a call that failed leaves no plan
    return out.squeeze(-1) if args.squeeze else out


def launch_plan(args):
    """Checked arguments -> (grid, the kernel's constants): all that their shapes and flags settle."""
    x, conv_state, weight, bias, silu, cache_seqlens, indices, _ = args
    batch, dim, tokens = x.shape
    token_tile, state_tile = pow2_at_least(tokens), pow2_at_least(conv_state.shape[2])
    dim_tile = dim_tile_for(batch, dim, token_tile, state_tile)
    return (batch, -(-dim // dim_tile)), (weight.shape[1], token_tile, dim_tile, state_tile, bias is not None,
                                          cache_seqlens is not None, indices is not None, silu)


def run_conv_update(args, settled=None):
    """Checked arguments -> out [batch, dim, tokens]; the one launch. ``settled``:
    launch_plan(args), or that of an earlier call with the same signature."""
    x, conv_state, weight, bias, _, cache_seqlens, indices, _ = args
    grid, constants = settled or launch_plan(args)
    out = new_output(*x.shape, dtype=x.dtype, device=x.device)
    unused = x  # stands in for absent optional arrays; never read
    launch(grid, causal_conv1d_update_kernel,
           (x, conv_state, weight, unused if bias is None else bias,
            unused if cache_seqlens is None else cache_seqlens.contiguous(),
            unused if indices is None else indices.contiguous(), out, *constants))
    return out


def dim_tile_for(batch, dim, token_tile, state_tile):
    """Channels per block: 128 for the usual single token, fewer when the one-hot selections
    (dim_tile x size x count) would grow large."""
    size = max(token_tile, state_tile)
    tile = 128
    while tile > 16 and tile * size * size > 16384:
        tile //= 2
    return tile
