"""C·B^T of every chunk, once per (batch, group), for compute_out to read.

The [chunk, chunk] score tile depends only on the group's B and C, not on the head: every head
of a group and every head tile of compute_out would otherwise recompute it. Kept in fp32, so
compute_out's result is the same as when it multiplies C·B^T itself. Worth its extra write and
reads when enough blocks share a tile (``choose_config``; docs/design.md, Decisions).
"""
import cuda.tile as ct
import torch

from ..runtime.launch import launch, new_output, tf32_mma


@ct.kernel
def group_scores_kernel(b, c, scores, chunk_size: ct.Constant[int], state_size: ct.Constant[int],
                        tf32: ct.Constant[bool]):
    batch_group, chunk = ct.bid(0), ct.bid(1)
    groups = b.shape[2]
    batch, group = batch_group // groups, batch_group % groups
    b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
    c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                     padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, state_size))
    mma_dtype = ct.tfloat32 if tf32 else b.dtype  # as compute_out_kernel's
    tile = ct.mma(c_tile.astype(mma_dtype), ct.transpose(b_tile.astype(mma_dtype)),
                  ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
    ct.store(scores, (batch, group, chunk, 0), tile.reshape((1, 1, chunk_size, chunk_size)))


def group_scores(b, c, num_chunks, chunk_size):
    """-> scores [batch, groups, num_chunks * chunk_size, chunk_size] fp32: rows are the chunk's
    tokens (C), columns the same chunk's tokens (B)."""
    batch, _, groups, state_size = b.shape
    scores = new_output(batch, groups, num_chunks * chunk_size, chunk_size, dtype=torch.float32, device=b.device)
    launch((batch * groups, num_chunks), group_scores_kernel, (b, c, scores, chunk_size, state_size, tf32_mma(b.dtype)))
    return scores
