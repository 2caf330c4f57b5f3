"""Variants of the chunk-state walk (tilegym_mamba2/cutile/chunk_states_walk.py), timed (GPU) or
compiled (CPU).

The walk is serial in the chunks: per chunk it loads x, b, the decay sums (and dt), then one mma
updates the state. Each variant edits the package's walk and nothing else, so its entry states and
final state must be the package's bits; timed forwards (the backward's scan) and in reverse (the
scan of dh) on the issue's two shapes, in interleaved rounds, same process, no L2 flush (the walk
streams GBs). Experiments 58 and 60 (latency hints on the loop's loads, adopted at 6; the next
chunk's tiles prefetched by hand; the entry state stored without TMA) are this file at f393bf7,
timed in run58 and run60; here are experiment 61's and 62's.

    python3 benchmarks/variants/walk_latency.py [B,T,G,H,N,P ...] [variant ...]
    python benchmarks/variants/walk_latency.py --resources [variant ...]   (CPU: what each compiles to
        at the 2.7B layer's JIT signatures, kernel_remarks.py)
"""
import pathlib
import sys

import torch

from chunk_grads_split import module_from  # this folder's
from tilegym_mamba2.cutile import scan

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "tilegym_mamba2" / "cutile" / "chunk_states_walk.py"
SHAPES = ("4,16384,1,8,128,64", "2,8192,1,80,128,64")
OCCUPANCY_3 = ("@ct.kernel(occupancy=2)", "@ct.kernel(occupancy=3)")
HALF_TILES = ("FEW_BLOCKS = 264 ", "FEW_BLOCKS = 10 ** 9 ")
VARIANTS = {
    "package": lambda: module_from(PACKAGE),
    # Experiment 61: the reverse walk's load of the following chunk's decay sums hinted as well,
    # and the 2.7B layer's 320 blocks at 64 x 64 against 640 at 64 x 32 now that loads overlap.
    "following6": lambda: module_from(PACKAGE, [(
        "(batch, head, min(chunk + 1, num_chunks - 1)), (1, 1, chunk_size))",
        "(batch, head, min(chunk + 1, num_chunks - 1)), (1, 1, chunk_size), latency=6)")]),
    "half_tiles": lambda: module_from(PACKAGE, [HALF_TILES]),
    # Experiment 62: the 2.7B layer's walk is 320 blocks where 264 fit at once (two per SM), so
    # its last 56 blocks run as a second wave: one wave from three blocks per SM, or from 160
    # blocks of 128 states.
    "occ3": lambda: module_from(PACKAGE, [OCCUPANCY_3]),
    "occ4": lambda: module_from(PACKAGE, [("@ct.kernel(occupancy=2)", "@ct.kernel(occupancy=4)")]),
    "occ3_half_tiles": lambda: module_from(PACKAGE, [OCCUPANCY_3, HALF_TILES]),
    # The rule before experiment 62 (occupancy 2 for every shape), against the package's 4 above
    # FEW_BLOCKS blocks.
    "occupancy2": lambda: module_from(PACKAGE, [
        ("crowded_walk_kernel if batch * heads * tiles > FEW_BLOCKS else chunk_states_walk_kernel",
         "chunk_states_walk_kernel")]),
    "state128": lambda: module_from(PACKAGE, [("state_tile = min(state_size, 64)", "state_tile = min(state_size, 128)")]),
}
ROUNDS = 3  # run58's single timings of the hints moved by up to 25% between shapes: every variant is
            # timed once per round, rounds interleaved, and the median of the rounds reported


def walk_inputs(shape):
    from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
    from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=64, device="cuda")
    i = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    dt_bht, decay_cumsum = chunk_cumsum(i["dt"], i["a"], 64)
    return i, dt_bht, decay_cumsum, torch.randn_like(i["x"]), torch.randn_like(i["init_state"])


def run(shape, names):
    import statistics
    from timing import median_ms  # this folder's (GPU)
    i, dt_bht, decay_cumsum, dy, dfinal = walk_inputs(shape)
    calls, want = {}, None
    for name in names:
        walk = VARIANTS[name]().chunk_states_walk
        calls[name] = {
            "forward": lambda walk=walk: walk(i["x"], i["b"], dt_bht, decay_cumsum, i["init_state"], 64),
            "reverse": lambda walk=walk: walk(dy, i["c"], decay_cumsum, decay_cumsum, dfinal, 64, reverse=True)}
        got = [t.clone() for call in calls[name].values() for t in call()]
        want = want or got
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        print(f"{shape} {name:18s} {'same bits as ' + names[0] if same else 'BITS DIFFER from ' + names[0]}", flush=True)
    rounds = {name: {k: [] for k in ("forward", "reverse")} for name in names}
    for _ in range(ROUNDS):
        for name in names:
            for k, call in calls[name].items():
                rounds[name][k].append(median_ms(call))
    for name in names:
        times = "  ".join(f"{k} {statistics.median(v):.3f} ms ({' '.join(f'{t:.3f}' for t in v)})"
                          for k, v in rounds[name].items())
        print(f"{shape} {name:18s} {times}", flush=True)


def resources(names):
    from kernel_remarks import backward_launches, compile_and_report
    original = scan.chunk_states_walk
    for name in names:
        scan.chunk_states_walk = VARIANTS[name]().chunk_states_walk
        launches = backward_launches((2, 8192, 1, 80, 128, 64))
        print(f"### {name}", flush=True)
        compile_and_report([(k, a) for k, a in launches if k._pyfunc.__name__.startswith("chunk_states_walk")])
    scan.chunk_states_walk = original


if __name__ == "__main__":
    chosen = [a for a in sys.argv[1:] if a in VARIANTS] or list(VARIANTS)
    if "--resources" in sys.argv:
        resources(chosen)
        sys.exit()
    for text in [a for a in sys.argv[1:] if "," in a] or SHAPES:
        run(tuple(int(v) for v in text.split(",")), chosen)
