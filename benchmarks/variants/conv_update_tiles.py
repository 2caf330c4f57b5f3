"""causal_conv1d_update's channel tile and occupancy (GPU), as experiment 37 did for the state
update: run35 measured 139 us at batch 256 on the 2.7B mixer (0.74x torch's roll-and-sum) against
a 6.4 us floor, about 3 us per block for 41 blocks per SM in turn, so the suspect is latency with
few blocks in flight.

Each variant is timed as the replay of a CUDA graph holding ``CALLS`` calls, each on its own
conv_state (timing.graph_us), checked to give the package's bits (out and conv_state). Inputs
are bench_serving's (HF's call form: x [batch, dim], conv_state [batch, dim, width], silu).

    python benchmarks/variants/conv_update_tiles.py [batch ...]
"""
import sys

import torch

from tilegym_mamba2 import bench_serving
from tilegym_mamba2.cutile import causal_conv1d_update as conv
from tilegym_mamba2.cutile import plan
from timing import graph_us, print_rows, variant_row  # this folder's

CALLS = 8
DIM_TILES = (128, 256, 512, 1024)
OCCUPANCIES = (None, 4, 8, 16)


def main(batches):
    default_tiles, default_kernel = conv.dim_tile_for, conv.causal_conv1d_update_kernel
    for batch in batches:
        case = bench_serving.ServingCase("causal_conv1d_update", batch)
        argsets = [bench_serving.conv_update_inputs(case, seed=i) for i in range(CALLS)]
        mbytes = bench_serving.floor_bytes(case) / 1e6
        start = argsets[0]["conv_state"].clone()

        def once():
            state = start.clone()
            return conv.causal_conv1d_update(**dict(argsets[0], conv_state=state)), state

        want = once()
        rows = [("as on main", graph_us([lambda a=a: conv.causal_conv1d_update(**a) for a in argsets]))]
        for dim_tile in DIM_TILES:
            for occupancy in OCCUPANCIES:
                name = f"dim_tile {dim_tile:4d} occupancy {occupancy}"
                plan.forget()  # a remembered launch plan would keep the last variant's tile
                conv.dim_tile_for = lambda *s, t=dim_tile: t
                conv.causal_conv1d_update_kernel = (default_kernel if occupancy is None
                                                    else default_kernel.replace_hints(occupancy=occupancy))
                rows.append(variant_row(name, lambda: all(torch.equal(g, w) for g, w in zip(once(), want)),
                                        [lambda a=a: conv.causal_conv1d_update(**a) for a in argsets]))
        conv.dim_tile_for, conv.causal_conv1d_update_kernel = default_tiles, default_kernel
        plan.forget()
        print_rows(f"batch {batch}", rows, mbytes)


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1, 64, 256])
