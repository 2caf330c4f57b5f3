"""The depthwise causal convolution of a prefill (causal_conv1d's causal_conv1d_fn).

    out[b, c, t] = act(bias[c] + sum_w weight[c, w] x[b, c, t - (width - 1) + w])

Inputs before the first token come from initial_states (else zeros). With seq_idx a token sees
only inputs of its own sequence, and tokens with a negative seq_idx are padding (out 0).

Each block computes a [token_tile, dim_tile] tile of one batch row. The kernel reads x as a
[batch, tokens, dim] view, so for the channel-last layout HF's Mamba-2 mixer passes
(x.stride(1) == 1) a tile's channels are contiguous; the output is written in x's layout. The
width shifted windows are gathered element-wise (tile loads start on tile boundaries only); they
overlap, so after the first they come from cache. The block holding the last tokens also writes
the final states, the last width - 1 inputs.
"""
import cuda.tile as ct

from ..runtime.limits import CUTILE as CUTILE_LIMITS
from .validation import check_conv_args
from ..core.tensors import pow2_at_least
from ..runtime.launch import launch, new_output

MAX_HISTORY = 4  # width - 1 <= 3, padded to a power of two


@ct.kernel
def causal_conv1d_kernel(x, weight, bias, seq_idx, initial_states, final_states, out,
                         width: ct.Constant[int], token_tile: ct.Constant[int], dim_tile: ct.Constant[int],
                         has_bias: ct.Constant[bool], has_seq: ct.Constant[bool], has_init: ct.Constant[bool],
                         has_final: ct.Constant[bool], silu: ct.Constant[bool]):
    token_block, dim_block, row = ct.bid(0), ct.bid(1), ct.bid(2)
    tokens = x.shape[1]
    t = token_block * token_tile + ct.arange(token_tile, dtype=ct.int32)            # [token_tile]
    channel = dim_block * dim_tile + ct.arange(dim_tile, dtype=ct.int32)            # [dim_tile]
    acc = ct.zeros((token_tile, dim_tile), dtype=ct.float32)
    if has_seq:
        seq = ct.gather(seq_idx, (row, t), padding_value=-1)
    for w in ct.static_iter(range(width)):
        source = t - (width - 1) + w
        tap = ct.gather(weight, (channel, w)).astype(ct.float32).reshape((1, dim_tile))
        inside = (source >= 0).reshape((token_tile, 1))
        value = ct.gather(x, (row, source.reshape((token_tile, 1)), channel.reshape((1, dim_tile))),
                          mask=inside).astype(ct.float32)
        if has_init:
            before = ct.gather(initial_states, (row, channel.reshape((1, dim_tile)),
                                                (source + (width - 1)).reshape((token_tile, 1))),
                               mask=(source < 0).reshape((token_tile, 1))).astype(ct.float32)
            value = value + before
        if has_seq:
            source_seq = ct.gather(seq_idx, (row, source), mask=source >= 0, padding_value=-1)
            value = ct.where((source_seq == seq).reshape((token_tile, 1)), value, 0.0)
        acc = acc + tap * value
    if has_bias:
        acc = acc + ct.gather(bias, channel).astype(ct.float32).reshape((1, dim_tile))
    if silu:
        acc = acc / (1.0 + ct.exp(-acc))
    if has_seq:
        acc = ct.where((seq >= 0).reshape((token_tile, 1)), acc, 0.0)
    ct.store(out, (row, token_block, dim_block), acc.astype(out.dtype).reshape((1, token_tile, dim_tile)))

    if has_final:
        if token_block == ct.num_blocks(0) - 1:
            k = ct.arange(MAX_HISTORY, dtype=ct.int32)                               # [MAX_HISTORY]
            source = tokens - (width - 1) + k
            wanted = (k < width - 1).reshape((MAX_HISTORY, 1))
            k_col, source_col = k.reshape((MAX_HISTORY, 1)), source.reshape((MAX_HISTORY, 1))
            channel_row = channel.reshape((1, dim_tile))
            last = ct.gather(x, (row, source_col, channel_row), mask=wanted & (source_col >= 0))
            if has_init:
                last = last + ct.gather(initial_states, (row, channel_row, source_col + (width - 1)),
                                        mask=wanted & (source_col < 0)).astype(x.dtype)
            ct.scatter(final_states, (row, channel_row, k_col), last.astype(final_states.dtype), mask=wanted)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal_conv1d's causal_conv1d_fn on CUDA tensors. Returns out like x (x's dtype and layout),
    then, with return_final_states, the final states [batch, dim, width - 1] (final_states_out
    when given)."""
    args = check_conv_args(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out,
                           activation, limits=CUTILE_LIMITS)
    out, final = run_conv(args)
    return (out, final) if args.return_final_states else out


def run_conv(args):
    """Checked arguments -> (out, final states or None); the one launch."""
    x, weight, bias, seq_idx, initial_states, return_final, final, silu = args
    batch, dim, tokens = x.shape
    width = weight.shape[1]
    channel_last = x.stride(1) == 1 and tokens > 1
    if channel_last:
        out = new_output(batch, tokens, dim, dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        out = new_output(batch, dim, tokens, dtype=x.dtype, device=x.device)
    if return_final and final is None:
        final = new_output(batch, dim, width - 1, dtype=x.dtype, device=x.device)
    token_tile, dim_tile = tiles_for(tokens, dim)
    grid = (-(-tokens // token_tile), -(-dim // dim_tile), batch)
    unused = x  # stands in for absent optional arrays; never read
    launch(grid, causal_conv1d_kernel,
           (x.transpose(1, 2), weight, unused if bias is None else bias,
            unused if seq_idx is None else seq_idx, unused if initial_states is None else initial_states,
            unused if final is None else final, out.transpose(1, 2),
            width, token_tile, dim_tile, bias is not None, seq_idx is not None, initial_states is not None,
            final is not None, silu))
    return out, final


def tiles_for(tokens, dim):
    """-> (token_tile, dim_tile): 64 x 64 tiles, fewer tokens for short inputs."""
    token_tile = min(64, pow2_at_least(tokens))
    return token_tile, 64
