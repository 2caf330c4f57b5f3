"""The causal depthwise convolution over a sequence split along tokens: each rank's first
outputs need the width - 1 inputs before its slice (its halo).

Every rank's last width - 1 inputs ([batch, dim, width - 1], independent of the tokens) go out
in one all-gather, not point to point from the previous rank only: a slice shorter than the
halo (one token, say) takes its halo from several ranks before it. The halo is prepended to the
slice and the single-GPU convolution runs on both; backward gathers the halos' gradients the
same way and each rank adds those that belong to its own last inputs.
"""
import torch
import torch.nn.functional as F

from ..backends.split_conv1d_scan import causal_conv1d_differentiable
from ..runtime.limits import PYTORCH as PYTORCH_LIMITS
from ..serving.validation import check_conv_args
from .agreement import agree, all_gather, check_group_device, edge_ids, fingerprints, group_or_world
from .lockstep import HALO_BACKWARD, in_step

OP = "context_parallel_causal_conv1d"


def halo_sources(layout, r: int, k: int):
    """For each of rank r's k halo positions (oldest first): (rank, position in that rank's
    zero-padded tail of k), or None before the global start."""
    starts = [sum(layout.lengths[:q]) for q in range(layout.size)]
    sources = []
    for token in range(starts[r] - k, starts[r]):
        if token < 0:
            sources.append(None)
            continue
        q = max(i for i in range(layout.size) if starts[i] <= token)
        sources.append((q, k - (starts[q] + layout.lengths[q] - token)))
    return sources


class Halo(torch.autograd.Function):
    """This rank's last min(tokens, k) inputs -> the k inputs before its slice, zeros before the
    global start; all ranks call it (and its backward) together."""

    @staticmethod
    def forward(ctx, tail, layout, k, group):
        n = tail.shape[-1]
        tails = all_gather(F.pad(tail, (k - n, 0)), group)                 # [ranks, batch, dim, k]
        ctx.layout, ctx.k, ctx.group, ctx.n = layout, k, group, n
        halo = tail.new_zeros(*tail.shape[:-1], k)
        for j, source in enumerate(halo_sources(layout, layout.rank, k)):
            if source is not None:
                halo[..., j] = tails[source[0], ..., source[1]]
        return halo

    @staticmethod
    def backward(ctx, d_halo):
        layout, k = ctx.layout, ctx.k
        in_step(layout.op, ctx.group, HALO_BACKWARD, layout.call)
        gathered = all_gather(d_halo, ctx.group)
        d_tail = d_halo.new_zeros(*d_halo.shape[:-1], k)
        for r in range(layout.rank + 1, layout.size):
            for j, source in enumerate(halo_sources(layout, r, k)):
                if source is not None and source[0] == layout.rank:
                    d_tail[..., source[1]] += gathered[r, ..., j]
        return d_tail[..., k - ctx.n:], None, None, None


def context_parallel_causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None, group=None):
    """causal_conv1d_fn over a sequence split along tokens, differentiable (training).

    x: this rank's slice [batch, dim, tokens] (any strides); weight [dim, width]; bias [dim] or None;
    seq_idx: this rank's slice [batch, tokens] of the global seq_idx, or None; activation: None,
    "silu" or "swish"; group: as in context_parallel_scan_combined. Returns this rank's out like x.
    """
    group = group_or_world(group)
    width = weight.shape[1] if isinstance(weight, torch.Tensor) and weight.ndim == 2 else 1

    def check():
        check_group_device(group, x.device)
        check_conv_args(x, weight, bias, seq_idx, None, False, None, activation, limits=PYTORCH_LIMITS)

    def signature():
        return {"x's [batch, dim]": tuple(x.shape[:2]), "x's dtype": str(x.dtype), "weight's shape": tuple(weight.shape),
                "bias (given or not)": bias is not None, "seq_idx (given or not)": seq_idx is not None,
                "activation": activation, **fingerprints(weight=weight, bias=bias)}

    tokens = x.shape[-1] if isinstance(x, torch.Tensor) and x.ndim == 3 else 0
    layout = agree(OP, group, check, signature, tokens, lambda: edge_ids(seq_idx, x.shape[0], tokens, width - 1))
    return conv_slice(layout, group, x, weight, bias, seq_idx, activation=activation)


def conv_slice(layout, group, x, weight, bias=None, seq_idx=None, activation=None):
    """This rank's part of the convolution, after agree() (with tail ids of width - 1)."""
    k = weight.shape[1] - 1
    if k == 0:
        return causal_conv1d_differentiable(x, weight, bias, seq_idx, activation=activation)
    tokens = x.shape[-1]
    halo = Halo.apply(x[..., tokens - min(tokens, k):], layout, k, group)
    if seq_idx is not None:
        ids = [_halo_ids(layout, k, row) for row in range(x.shape[0])]
        seq_idx = torch.cat([torch.tensor(ids, dtype=seq_idx.dtype, device=seq_idx.device), seq_idx], 1)
    out = causal_conv1d_differentiable(torch.cat([halo, x], -1), weight, bias, seq_idx, activation=activation)
    return out[..., k:]


def _halo_ids(layout, k, row):
    """The sequence ids of this rank's halo in ``row`` (-1, no sequence, before the global start)."""
    ids = []
    for source in halo_sources(layout, layout.rank, k):
        if source is None:
            ids.append(-1)
        else:
            tail = layout.tail_ids[source[0]][row]
            ids.append(tail[source[1] - (k - len(tail))])
    return ids
