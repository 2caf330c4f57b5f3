"""Experiment 67 (GPU; compiles on a CPU with --resources): selective_state_update with a
persistent grid against the package's one block per tile and mamba_ssm's kernel.

At batch 8 (2.7B mixer, HF's call form) the package's 2560 blocks of 16 x 128 state elements run
as 2.4 waves of 1056 (8 per SM): the last wave is 40% full, and the step stays 0.87x mamba_ssm's
in CUDA-graph replay (experiment 37). Here a fixed number of blocks (SMs x blocks per SM) walk the
tiles with a stride of the grid, so a block's next tile is loaded while others compute, and
smaller tiles (4 or 8 rows) spread the work evenly without the per-block start-up cost that made
them 2-3x slower as blocks of their own. Same arithmetic per tile as the package (its `_update`),
so the same bits. Timed as state_update_tiles.py does: CUDA-graph replay of CALLS calls, each on
its own state.

    python3 benchmarks/variants/state_update_persistent.py [batch ...]
    python benchmarks/variants/state_update_persistent.py --resources   (CPU: compiles for sm_90)
"""
import sys

import cuda.tile as ct
import torch

from tilegym_mamba2.cutile import selective_state_update as ssu

CALLS = 8
SMS = 132  # an H200's
VARIANTS = [(head_tile, per_sm) for head_tile in (4, 8, 16) for per_sm in (8, 16)]
_HINTED = {}  # per_sm -> the kernel with that occupancy hint, made once: a new kernel object loads
              # its module on first launch, which a CUDA-graph capture forbids (run71 aborted so)


@ct.kernel(occupancy=8)
def persistent_state_update_kernel(state, x, dt, dt_bias, A, B, C, D, z, indices, out,
                                   head_tile: ct.Constant[int], state_tile: ct.Constant[int],
                                   dt_mode: ct.Constant[int], a_mode: ct.Constant[int], d_mode: ct.Constant[int],
                                   has_bias: ct.Constant[bool], has_d: ct.Constant[bool], has_z: ct.Constant[bool],
                                   softplus: ct.Constant[bool], has_indices: ct.Constant[bool]):
    # The package kernel's arguments (indices unread: calls here have none), one grid axis.
    heads = x.shape[1]
    p_tiles = (x.shape[2] + head_tile - 1) // head_tile
    per_row = heads * p_tiles
    for t in range(ct.bid(0), x.shape[0] * per_row, ct.num_blocks(0)):
        row = t // per_row
        head = (t % per_row) // p_tiles
        ssu._update(state, x, dt, dt_bias, A, B, C, D, z, out, row, row, head, t % p_tiles, head_tile, state_tile,
                    dt_mode, a_mode, d_mode, has_bias, has_d, has_z, softplus)


def persistent_call(kwargs, head_tile, per_sm):
    """selective_state_update(**kwargs) (no state_batch_indices) through the package's host code
    (run_state_update), its kernel swapped for the persistent one on SMS x per_sm blocks."""
    assert kwargs.get("state_batch_indices") is None
    args = ssu.state_update_args(**{k: kwargs.get(k) for k in ("state", "x", "dt", "A", "B", "C", "D", "z",
                                                                "dt_bias", "dt_softplus", "state_batch_indices")})
    (batch, heads, _), constants = ssu.launch_plan(args)
    tiles = batch * heads * -(-args[1].shape[2] // head_tile)
    package_kernel = ssu.selective_state_update_kernel
    if per_sm not in _HINTED:
        _HINTED[per_sm] = persistent_state_update_kernel.replace_hints(occupancy=per_sm)
    ssu.selective_state_update_kernel = _HINTED[per_sm]
    try:
        return ssu.run_state_update(args, ((min(tiles, SMS * per_sm),), (head_tile, *constants[1:])))
    finally:
        ssu.selective_state_update_kernel = package_kernel


def main(batches):
    from tilegym_mamba2 import bench_serving
    from timing import graph_us, print_rows, variant_row  # this folder's
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as peer
    except Exception as e:  # noqa: BLE001
        peer = None
        print(f"mamba_ssm not importable: {type(e).__name__}")
    for batch in batches:
        case = bench_serving.ServingCase("selective_state_update", batch)
        argsets = [bench_serving.state_update_inputs(case, seed=i) for i in range(CALLS)]
        ref = argsets[0]["state"].clone()
        want = ssu.selective_state_update(**dict(argsets[0], state=ref.clone()))
        rows = []
        if peer is not None:
            rows.append(("mamba_ssm", graph_us([lambda a=a: peer(**a) for a in argsets])))
        rows.append(("package (one block per tile)",
                     graph_us([lambda a=a: ssu.selective_state_update(**a) for a in argsets])))
        for head_tile, per_sm in VARIANTS:
            rows.append(variant_row(
                f"persistent, head_tile {head_tile:2d}, {per_sm:2d} blocks per SM",
                lambda h=head_tile, o=per_sm: torch.equal(
                    persistent_call(dict(argsets[0], state=ref.clone()), h, o), want),
                [lambda a=a, h=head_tile, o=per_sm: persistent_call(a, h, o) for a in argsets]))
        print_rows(f"batch {batch}", rows, bench_serving.floor_bytes(case) / 1e6)


def resources():
    """Compiles the variants for sm_90 on CPU placeholders of batch 8 (no GPU)."""
    from kernel_remarks import compile_and_report  # this folder's
    from tilegym_mamba2 import bench_serving
    from tilegym_mamba2.cutile.launch import recording_launches
    kwargs = bench_serving.state_update_inputs(bench_serving.ServingCase("selective_state_update", 8), device="cpu")
    with recording_launches() as launches:
        for head_tile, per_sm in VARIANTS:
            persistent_call(kwargs, head_tile, per_sm)
    compile_and_report(launches)


if __name__ == "__main__":
    if "--resources" in sys.argv:
        resources()
    else:
        main([int(b) for b in sys.argv[1:]] or [1, 8, 64, 256])
