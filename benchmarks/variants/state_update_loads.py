"""Experiment 71 (GPU; compiles on a CPU with --resources): selective_state_update's loads and
stores without TMA, against the package and mamba_ssm's kernel.

At batch 1 / 8 (2.7B mixer, HF's call form) the decode step stays 0.85x / 0.88x mamba_ssm in
CUDA-graph replay (run74), neither the tile's height nor a persistent grid helping (experiments
37, 67). tileiras turns five of the package's loads (the state tile, x, B, C, z) and both stores
into TMA (`cpu_sm90/state_update_loads71.log`): each a descriptor, a shared-memory stage and an
mbarrier wait, for tiles of 32 B (x, z, out) to 8 KB (the state) in a block whose whole life is one
dependent chain of them. Here the same kernel (the package's text, edited) with `allow_tma=False`
on the small vectors, on the state's load, on the stores, or on all, each at 16-row tiles (the
package's) and at 8 and 4 rows (mamba_ssm's block at state 128), through the package's host code:
the same arithmetic, so the same bits (checked per variant). Timed as state_update_tiles.py does.

Result (run78): the stores off TMA won (NOTES.md, experiment 71) and are in the package since,
so the "stores" and "all" edits no longer apply to it: run this at 517fadb.

    python3 benchmarks/variants/state_update_loads.py [batch ...]
    python benchmarks/variants/state_update_loads.py --resources   (CPU: compiles for sm_90)
"""
import pathlib
import sys

import torch

from edited import module_from  # this folder's
from tilegym_mamba2 import bench_serving
from tilegym_mamba2.cutile import plan
from tilegym_mamba2.cutile import selective_state_update as ssu

CALLS = 8
PACKAGE = pathlib.Path(ssu.__file__)
VECTORS = [
    ("ct.load(x, (row, head, p_tile), (1, 1, head_tile), padding_mode=zero)",
     "ct.load(x, (row, head, p_tile), (1, 1, head_tile), padding_mode=zero, allow_tma=False)"),
    ("ct.load(B, (row, group, 0), (1, 1, state_tile), padding_mode=zero)",
     "ct.load(B, (row, group, 0), (1, 1, state_tile), padding_mode=zero, allow_tma=False)"),
    ("ct.load(C, (row, group, 0), (1, 1, state_tile), padding_mode=zero)",
     "ct.load(C, (row, group, 0), (1, 1, state_tile), padding_mode=zero, allow_tma=False)"),
    ("ct.load(z, (row, head, p_tile), (1, 1, head_tile), padding_mode=zero)",
     "ct.load(z, (row, head, p_tile), (1, 1, head_tile), padding_mode=zero, allow_tma=False)"),
]
STATE = [("ct.load(state, (slot, head, p_tile, 0), (1, 1, head_tile, state_tile), padding_mode=zero)",
          "ct.load(state, (slot, head, p_tile, 0), (1, 1, head_tile, state_tile), padding_mode=zero, allow_tma=False)")]
STORES = [
    ("h.astype(state.dtype).reshape((1, 1, head_tile, state_tile)))",
     "h.astype(state.dtype).reshape((1, 1, head_tile, state_tile)), allow_tma=False)"),
    ("ct.store(out, (row, head, p_tile), y.reshape((1, 1, head_tile)).astype(out.dtype))",
     "ct.store(out, (row, head, p_tile), y.reshape((1, 1, head_tile)).astype(out.dtype), allow_tma=False)"),
]
EDITS = {"nothing": [], "vectors": VECTORS, "state": STATE, "stores": STORES, "all": VECTORS + STATE + STORES}
VARIANTS = [(edits, head_tile) for edits in EDITS for head_tile in (16, 8, 4)]


def kernel_with(edits):
    """The package's decode kernel with textual edits (each must apply once), from a copy of the module."""
    return module_from(PACKAGE, EDITS[edits], stem=f"state_update_{edits}").selective_state_update_kernel


PACKAGE_KERNEL, PACKAGE_TILES = ssu.selective_state_update_kernel, ssu.tiles_for


def use(kernel, head_tile):
    """Routes the package's host code to ``kernel`` at ``head_tile`` rows per block; no plan kept."""
    plan.forget()  # a remembered launch plan would keep the last variant's tiles
    ssu.selective_state_update_kernel = kernel
    ssu.tiles_for = lambda *shape: (head_tile, PACKAGE_TILES(*shape)[1])


def main(batches):
    from timing import graph_us, print_rows, variant_row  # this folder's
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as peer
    except Exception as e:  # noqa: BLE001
        peer = None
        print(f"mamba_ssm not importable: {type(e).__name__}")
    kernels = {edits: kernel_with(edits) for edits in EDITS}
    for batch in batches:
        case = bench_serving.ServingCase("selective_state_update", batch)
        argsets = [bench_serving.state_update_inputs(case, seed=i) for i in range(CALLS)]
        ref = argsets[0]["state"].clone()
        use(PACKAGE_KERNEL, PACKAGE_TILES(case.head_size, case.state_size)[0])
        want = ssu.selective_state_update(**dict(argsets[0], state=ref.clone()))
        rows = []
        if peer is not None:
            rows.append(("mamba_ssm", graph_us([lambda a=a: peer(**a) for a in argsets])))
        for edits, head_tile in VARIANTS:
            use(kernels[edits], head_tile)
            rows.append(variant_row(
                f"TMA off for {edits:8s} head_tile {head_tile:2d}",
                lambda: torch.equal(ssu.selective_state_update(**dict(argsets[0], state=ref.clone())), want),
                [lambda a=a: ssu.selective_state_update(**a) for a in argsets]))
        use(PACKAGE_KERNEL, PACKAGE_TILES(case.head_size, case.state_size)[0])
        ssu.tiles_for = PACKAGE_TILES
        print_rows(f"batch {batch}", rows, bench_serving.floor_bytes(case) / 1e6)


def resources():
    """Compiles every variant for sm_90 on CPU placeholders of batch 8 (no GPU)."""
    from kernel_remarks import compile_and_report  # this folder's
    from tilegym_mamba2.cutile.launch import recording_launches
    kwargs = bench_serving.state_update_inputs(bench_serving.ServingCase("selective_state_update", 8), device="cpu")
    args = ssu.state_update_args(**{k: kwargs.get(k) for k in ("state", "x", "dt", "A", "B", "C", "D", "z",
                                                                "dt_bias", "dt_softplus", "state_batch_indices")})
    for edits, head_tile in VARIANTS:
        use(kernel_with(edits), head_tile)
        with recording_launches() as launches:
            ssu.run_state_update(args, ssu.launch_plan(args))
        print(f"### TMA off for {edits}, head_tile {head_tile}", flush=True)
        compile_and_report(launches)
    ssu.selective_state_update_kernel, ssu.tiles_for = PACKAGE_KERNEL, PACKAGE_TILES


if __name__ == "__main__":
    if "--resources" in sys.argv:
        resources()
    else:
        main([int(b) for b in sys.argv[1:]] or [1, 8, 64, 256])
