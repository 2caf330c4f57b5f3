"""Experiment 37: selective_state_update's tile and occupancy against mamba_ssm's kernel (GPU).

Each variant is timed as the replay of a CUDA graph holding ``CALLS`` calls, each on its own
state (together over the 50 MB L2 from batch 8 on), so the host's launch time is not counted:
GPU microseconds per call, and the state's bytes moved per second. The decode step's inputs are
bench_serving's (2.7B mixer, HF's call form).

    python benchmarks/variants/state_update_tiles.py [batch ...]
"""
import sys

import torch

from tilegym_mamba2 import bench_serving
from tilegym_mamba2.cutile import plan
from tilegym_mamba2.cutile import selective_state_update as ssu
from timing import graph_us, print_rows, variant_row  # this folder's

CALLS = 8
HEAD_TILES = (4, 8, 16, 32, 64)
OCCUPANCIES = (None, 2, 4, 8, 16)


def main(batches):
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as peer
    except Exception as e:  # noqa: BLE001
        peer = None
        print(f"mamba_ssm not importable: {type(e).__name__}")
    default_tiles, default_kernel = ssu.tiles_for, ssu.selective_state_update_kernel
    for batch in batches:
        case = bench_serving.ServingCase("selective_state_update", batch)
        argsets = [bench_serving.state_update_inputs(case, seed=i) for i in range(CALLS)]
        gbytes = bench_serving.floor_bytes(case) / 1e9
        ref = argsets[0]["state"].clone()
        rows = []
        if peer is not None:
            us = graph_us([lambda a=a: peer(**a) for a in argsets])
            rows.append(("mamba_ssm", us))
        head_tile0, _ = default_tiles(case.head_size, case.state_size)
        rows.append((f"ours as on main (head_tile {head_tile0})",
                     graph_us([lambda a=a: ssu.selective_state_update(**a) for a in argsets])))
        want = ssu.selective_state_update(**dict(argsets[0], state=ref.clone()))
        for head_tile in HEAD_TILES:
            for occupancy in OCCUPANCIES:
                name = f"head_tile {head_tile:2d} occupancy {occupancy}"
                plan.forget()  # a remembered launch plan would keep the last variant's tiles
                ssu.tiles_for = lambda *s, h=head_tile: (h, default_tiles(*s)[1])
                ssu.selective_state_update_kernel = (default_kernel if occupancy is None
                                                     else default_kernel.replace_hints(occupancy=occupancy))
                rows.append(variant_row(
                    name, lambda: torch.equal(ssu.selective_state_update(**dict(argsets[0], state=ref.clone())), want),
                    [lambda a=a: ssu.selective_state_update(**a) for a in argsets]))
        ssu.tiles_for, ssu.selective_state_update_kernel = default_tiles, default_kernel
        plan.forget()
        print_rows(f"batch {batch}", rows, gbytes * 1e3)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1, 8, 64, 256])
