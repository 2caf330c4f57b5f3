"""One decode step of the selective state space recurrence (mamba_ssm's selective_state_update).

    dt = softplus?(dt + dt_bias)
    state = exp(A dt) state + dt x B^T      (in place)
    out = state C + D x,  out *= silu(z)

Memory bound: each block reads and writes one [head_tile, state_size] tile of one head's state
once, in one pass, and reads a few vectors. Mamba-2 passes dt, dt_bias, A and D expanded from
per-head values with stride 0 (HF's mixer does); those are recognised by their strides and read
as one scalar per head, so no per-channel or per-element copy of them is read. Whatever is not
expanded is read per channel, and A per element when it has one value per element (Mamba-1).

With state_batch_indices, batch row i updates state[state_batch_indices[i]]; a negative index is
a padding row: its output is zeros and its block reads and writes no state.
"""
import cuda.tile as ct

from ..runtime.limits import CUTILE as CUTILE_LIMITS
from .validation import check_state_update_args, state_update_args
from ..core.tensors import pow2_at_least
from ..runtime import plan
from ..core.constants import SOFTPLUS_THRESHOLD
from ..runtime.tile_math import log1p
from ..runtime.launch import launch, new_output

# How dt (with dt_bias), A and D vary inside one head.
PER_HEAD, PER_CHANNEL, PER_ELEMENT = 0, 1, 2


# Eight blocks per SM: a block's loads are one dependent chain (state, then the update, then the
# store), so the bandwidth comes from many blocks in flight (docs/design.md, Decisions).
@ct.kernel(occupancy=8)
def selective_state_update_kernel(state, x, dt, dt_bias, A, B, C, D, z, indices, out,
                                  head_tile: ct.Constant[int], state_tile: ct.Constant[int],
                                  dt_mode: ct.Constant[int], a_mode: ct.Constant[int], d_mode: ct.Constant[int],
                                  has_bias: ct.Constant[bool], has_d: ct.Constant[bool], has_z: ct.Constant[bool],
                                  softplus: ct.Constant[bool], has_indices: ct.Constant[bool]):
    row, head, p_tile = ct.bid(0), ct.bid(1), ct.bid(2)
    # Small grids are launched as programmatic dependents (run_state_update): nothing is read before
    # the kernel ahead has finished, and the next one may be scheduled from here on. Launched
    # without the flag, both are no-ops.
    ct.grid_dependency_control_wait()
    ct.grid_dependency_control_launch_dependents()
    if has_indices:
        slot = ct.gather(indices, row)
        # A negative index is a padding row; so is one past the last slot: nothing out of bounds
        # is read or written (indices live on the device, so the host checks cannot see them).
        if (slot >= 0) & (slot < state.shape[0]):
            _update(state, x, dt, dt_bias, A, B, C, D, z, out, row, slot, head, p_tile, head_tile, state_tile,
                    dt_mode, a_mode, d_mode, has_bias, has_d, has_z, softplus)
        else:
            ct.store(out, (row, head, p_tile), ct.zeros((1, 1, head_tile), dtype=out.dtype))
    else:
        _update(state, x, dt, dt_bias, A, B, C, D, z, out, row, row, head, p_tile, head_tile, state_tile,
                dt_mode, a_mode, d_mode, has_bias, has_d, has_z, softplus)


@ct.function
def _update(state, x, dt, dt_bias, A, B, C, D, z, out, row, slot, head, p_tile, head_tile, state_tile,
            dt_mode, a_mode, d_mode, has_bias, has_d, has_z, softplus):
    zero = ct.PaddingMode.ZERO
    group = head // (x.shape[1] // B.shape[1])
    h = ct.load(state, (slot, head, p_tile, 0), (1, 1, head_tile, state_tile), padding_mode=zero)
    h = h.reshape((head_tile, state_tile)).astype(ct.float32)
    x_col = ct.load(x, (row, head, p_tile), (1, 1, head_tile), padding_mode=zero).reshape(
        (head_tile, 1)).astype(ct.float32)

    # dt: [1, 1] for the head or [head_tile, 1] per channel.
    if dt_mode == PER_HEAD:
        step = ct.load(dt, (row, head), (1, 1)).astype(ct.float32)
        if has_bias:
            step = step + ct.load(dt_bias, (head,), (1,)).reshape((1, 1)).astype(ct.float32)
    else:
        step = ct.load(dt, (row, head, p_tile), (1, 1, head_tile), padding_mode=zero).reshape(
            (head_tile, 1)).astype(ct.float32)
        if has_bias:
            step = step + ct.load(dt_bias, (head, p_tile), (1, head_tile), padding_mode=zero).reshape(
                (head_tile, 1)).astype(ct.float32)
    if softplus:
        step = ct.where(step > SOFTPLUS_THRESHOLD, step, log1p(ct.exp(step)))

    if a_mode == PER_HEAD:
        a = ct.load(A, (head,), (1,)).reshape((1, 1)).astype(ct.float32)
    elif a_mode == PER_CHANNEL:
        a = ct.load(A, (head, p_tile), (1, head_tile), padding_mode=zero).reshape((head_tile, 1)).astype(ct.float32)
    else:
        a = ct.load(A, (head, p_tile, 0), (1, head_tile, state_tile), padding_mode=zero).reshape(
            (head_tile, state_tile)).astype(ct.float32)
    b = ct.load(B, (row, group, 0), (1, 1, state_tile), padding_mode=zero).reshape((1, state_tile)).astype(ct.float32)
    c = ct.load(C, (row, group, 0), (1, 1, state_tile), padding_mode=zero).reshape((1, state_tile)).astype(ct.float32)

    h = ct.exp(a * step) * h + (step * x_col) * b
    # Plain stores, not TMA (which tileiras picks by default): a TMA store stages the tile in shared
    # memory and waits on it, at the end of a block whose life is one dependent chain. Same bits,
    # 8% / 7% faster at batch 1 / 8, equal from batch 64.
    ct.store(state, (slot, head, p_tile, 0), h.astype(state.dtype).reshape((1, 1, head_tile, state_tile)),
             allow_tma=False)

    y = ct.sum(h * c, axis=1, keepdims=True)                     # [head_tile, 1]
    if has_d:
        if d_mode == PER_HEAD:
            skip = ct.load(D, (head,), (1,)).reshape((1, 1)).astype(ct.float32)
        else:
            skip = ct.load(D, (head, p_tile), (1, head_tile), padding_mode=zero).reshape(
                (head_tile, 1)).astype(ct.float32)
        y = y + skip * x_col
    if has_z:
        gate = ct.load(z, (row, head, p_tile), (1, 1, head_tile), padding_mode=zero).reshape(
            (head_tile, 1)).astype(ct.float32)
        y = y * gate / (1.0 + ct.exp(-gate))
    ct.store(out, (row, head, p_tile), y.reshape((1, 1, head_tile)).astype(out.dtype), allow_tma=False)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """mamba_ssm's selective_state_update on CUDA tensors: updates ``state`` in place and returns
    out like x (x's dtype). Shapes: see tilegym_mamba2.selective_state_update. A repeated call
    (the same shapes, strides, dtypes, devices and flags) skips the checks and the mode detection:
    its plan (plan.py) holds the launch's grid and constants."""
    key = plan.signature("selective_state_update", state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                         state_batch_indices, strides=True)
    planned = plan.planned(key)
    if planned is None:
        args = check_state_update_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                                       limits=CUTILE_LIMITS)
    else:
        args = state_update_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    settled = planned or launch_plan(args)
    out = run_state_update(args, settled)
    if planned is None:
        plan.remember(key, settled)  # after the launch, as the forward: a call that failed leaves no plan
    return out if args.has_heads else out.squeeze(1)


def launch_plan(args):
    """Checked arguments -> (grid, the kernel's constants): all that their shapes, strides and
    flags settle. dt (with dt_bias), A and D are read once per head where they are constant over
    head_size (expanded with stride 0, or of size 1), and A once per channel where it is constant
    over state_size."""
    state, x, dt, A, B, C, D, z, dt_bias, softplus, indices, _ = args
    batch, heads, head_size = x.shape
    dt_mode = PER_HEAD if _constant_over(dt, 2) and (dt_bias is None or _constant_over(dt_bias, 1)) else PER_CHANNEL
    a_mode = (PER_HEAD if _constant_over(A, 1) and _constant_over(A, 2)
              else PER_CHANNEL if _constant_over(A, 2) else PER_ELEMENT)
    d_mode = PER_HEAD if D is not None and _constant_over(D, 1) else PER_CHANNEL
    head_tile, state_tile = tiles_for(head_size, state.shape[3])
    grid = (batch, heads, -(-head_size // head_tile))
    return grid, (head_tile, state_tile, dt_mode, a_mode, d_mode, dt_bias is not None, D is not None, z is not None,
                  bool(softplus), indices is not None)


def run_state_update(args, settled=None):
    """Checked arguments (per-head form) -> out [batch, heads, head_size]; the one launch.
    ``settled``: launch_plan(args), or that of an earlier call with the same signature."""
    state, x, dt, A, B, C, D, z, dt_bias, _, indices, _ = args
    grid, constants = settled or launch_plan(args)
    dt_mode, a_mode, d_mode = constants[2:5]  # in the kernel's order, after head_tile and state_tile
    # The views read once per head or channel (x[..., 0] costs ~0.3 us less than x[:, :, 0]).
    if dt_mode == PER_HEAD:
        dt, dt_bias = dt[..., 0], None if dt_bias is None else dt_bias[..., 0]
    A = A[..., 0, 0] if a_mode == PER_HEAD else A[..., 0] if a_mode == PER_CHANNEL else A
    if D is not None and d_mode == PER_HEAD:
        D = D[..., 0]
    # What is still expanded (a zero stride along a dimension read per element) is made dense.
    dt, dt_bias, A, D, x, z, B, C = map(_dense, (dt, dt_bias, A, D, x, z, B, C))
    if indices is not None:
        indices = indices.contiguous()

    out = new_output(*x.shape, dtype=x.dtype, device=x.device)
    unused = x  # stands in for absent optional arrays; never read
    launch(grid, selective_state_update_kernel,
           (state, x, dt, unused if dt_bias is None else dt_bias, A, B, C, unused if D is None else D,
            unused if z is None else z, unused if indices is None else indices, out, *constants),
           dependent=grid[0] * grid[1] * grid[2] <= DEPENDENT_LAUNCH_MAX_BLOCKS)
    return out


# A step of a few microseconds is mostly launch latency: launched as a programmatic dependent, its
# blocks are scheduled while the kernel ahead drains. In CUDA-graph replay of the 2.7B mixer's
# step it helped small batches and cost the largest grids a few percent (docs/design.md,
# Decisions); hence only grids up to this many blocks.
DEPENDENT_LAUNCH_MAX_BLOCKS = 8192


def tiles_for(head_size, state_size):
    """-> (head_tile, state_tile): the whole state row (state_size padded to a power of two) and
    enough rows for 2048 elements per block (8 KiB of fp32 state). At 8 blocks per SM this moved
    the state at 3.3-3.5 TB/s on the H200 from batch 64 on, where 4096-element blocks at the
    default occupancy moved it at 1.4 TB/s."""
    state_tile = pow2_at_least(state_size)
    head_tile = max(1, min(pow2_at_least(head_size), 2048 // state_tile))
    return head_tile, state_tile


def _constant_over(t, dim):
    return t.shape[dim] == 1 or t.stride(dim) == 0


def _dense(t):
    # is_contiguous first: ~0.05 us where the stride scan costs ~1 us, and the usual case.
    if t is None or t.is_contiguous() or all(s != 0 or n == 1 for s, n in zip(t.stride(), t.shape)):
        return t
    return t.contiguous()
