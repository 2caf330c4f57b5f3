"""Experiment 58 (GPU): the chunk-state walk's loop loads with cuTile latency hints.

The walk (tilegym_mamba2/cutile/chunk_states_walk.py) is serial in the chunks: per chunk it loads
x, b, the decay sums (and dt), then one mma updates the state. Nothing in a chunk's loads depends
on the state, so they could be in flight while the previous chunk's mma runs; the kernel gives
the compiler no latency hint (compute_out's hint was worth 1.4-1.6x on the layer op, experiment
31). Each variant adds ``latency=N`` to the loop's loads and nothing else, so its entry states
and final state must be the package's bits; timed forwards (the backward's scan) and in reverse
(the scan of dh) on the issue's two shapes, same process, no L2 flush (the walk streams GBs).

    python3 benchmarks/variants/walk_latency.py [B,T,G,H,N,P ...] [variant ...]
    python benchmarks/variants/walk_latency.py --resources [variant ...]   (CPU: what each compiles to
        at the 2.7B layer's JIT signatures, kernel_remarks.py)
"""
import pathlib
import subprocess
import sys
import tempfile

import torch

from chunk_grads_split import module_from  # this folder's
from tilegym_mamba2.cutile import scan

HERE = pathlib.Path(__file__).resolve().parent
# The walk as it was when these variants were timed (run58, run60): latency=6 is in the package since.
BEFORE_HINTS = "f393bf7"


def walk_source(commit=BEFORE_HINTS):
    """chunk_states_walk.py at ``commit``, as a file that module_from can edit."""
    text = subprocess.run(["git", "show", f"{commit}:tilegym_mamba2/cutile/chunk_states_walk.py"], cwd=HERE,
                          capture_output=True, text=True, check=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "chunk_states_walk.py"
    path.write_text(text)
    return path


CURRENT = HERE.parents[1] / "tilegym_mamba2" / "cutile" / "chunk_states_walk.py"
SHAPES = ("4,16384,1,8,128,64", "2,8192,1,80,128,64")
LOOP_LOADS = (  # (text before the hint, text after it) of each load inside the loop
    ("x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),\n"
     "                         padding_mode=ct.PaddingMode.ZERO", ")"),
    ("b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),\n"
     "                      padding_mode=ct.PaddingMode.ZERO", ")"),
    ("g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)", ")"),
    ("dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)", ")"),
)


PREFETCH_LOOP = '    for step in range(num_chunks):\n        chunk = num_chunks - 1 - step if reverse else step\n        ct.store(entry_states, (batch, head, step * state_tiles + n_tile, p_tile),\n                 state_t.reshape((1, 1, state_tile, head_tile)))\n        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),\n                         padding_mode=ct.PaddingMode.ZERO).reshape((chunk_size, head_tile))\n        b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),\n                      padding_mode=ct.PaddingMode.ZERO).reshape((state_tile, chunk_size))\n        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))\n        g_last = ct.extract(g, (chunk_size - 1,), (1,))\n        if reverse:\n            g_first = ct.extract(g, (0,), (1,))\n            following = ct.load(decay_cumsum, (batch, head, min(chunk + 1, num_chunks - 1)), (1, 1, chunk_size))\n            next_first = ct.extract(following.reshape((chunk_size,)), (0,), (1,))\n            next_first = ct.where(chunk + 1 < num_chunks, next_first, 0.0)\n            keep = ct.exp2(g_last - g_first + next_first).reshape((1, 1))\n            weight = ct.exp2(g - g_first)\n        else:\n            keep = ct.exp2(g_last).reshape((1, 1))\n            dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,))\n            weight = dt_tile * ct.exp2(g_last - g)\n', '    first_chunk = num_chunks - 1 if reverse else 0\n    x_tile, b_t, g, dt_tile = _chunk_tiles(x, b, dt_bht, decay_cumsum, batch, head, group, first_chunk, p_tile,\n                                           n_tile, chunk_size, head_tile, state_tile, reverse)\n    next_first = ct.zeros((1,), dtype=ct.float32)\n    for step in range(num_chunks):\n        ct.store(entry_states, (batch, head, step * state_tiles + n_tile, p_tile),\n                 state_t.reshape((1, 1, state_tile, head_tile)))\n        following = min(step + 1, num_chunks - 1)\n        x_next, b_next, g_next, dt_next = _chunk_tiles(\n            x, b, dt_bht, decay_cumsum, batch, head, group, num_chunks - 1 - following if reverse else following,\n            p_tile, n_tile, chunk_size, head_tile, state_tile, reverse)\n        g_last = ct.extract(g, (chunk_size - 1,), (1,))\n        if reverse:\n            g_first = ct.extract(g, (0,), (1,))\n            keep = ct.exp2(g_last - g_first + next_first).reshape((1, 1))\n            weight = ct.exp2(g - g_first)\n            next_first = g_first\n        else:\n            keep = ct.exp2(g_last).reshape((1, 1))\n            weight = dt_tile * ct.exp2(g_last - g)\n'
PREFETCH_TAIL = '        state_t = state_t * keep + ct.mma(weighted_b, x_tile, ct.zeros((state_tile, head_tile), dtype=ct.float32))\n', '        state_t = state_t * keep + ct.mma(weighted_b, x_tile, ct.zeros((state_tile, head_tile), dtype=ct.float32))\n        x_tile, b_t, g, dt_tile = x_next, b_next, g_next, dt_next\n'
CHUNK_TILES = '@ct.function\ndef _chunk_tiles(x, b, dt_bht, decay_cumsum, batch, head, group, chunk, p_tile, n_tile, chunk_size, head_tile,\n                 state_tile, reverse):\n    x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),\n                     padding_mode=ct.PaddingMode.ZERO{hint}).reshape((chunk_size, head_tile))\n    b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),\n                  padding_mode=ct.PaddingMode.ZERO{hint}).reshape((state_tile, chunk_size))\n    g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size){hint}).reshape((chunk_size,))\n    if reverse:\n        dt_tile = g\n    else:\n        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size){hint}).reshape((chunk_size,))\n    return x_tile, b_t, g, dt_tile\n\n\n@ct.kernel(occupancy=2)\n'


ENTRY_STORE_NO_TMA = ("                 state_t.reshape((1, 1, state_tile, head_tile)))\n",
                      "                 state_t.reshape((1, 1, state_tile, head_tile)), allow_tma=False)\n")


def prefetched(latency, store_tma=True):
    """Experiment 60: the next chunk's tiles loaded before this chunk's update, carried through the
    loop (the mma does not depend on the state, so only the loads' latency is serial); in reverse
    the following chunk's first decay sum is the previous step's, no longer loaded."""
    hint = f", latency={latency}" if latency else ""
    edits = [PREFETCH_LOOP, PREFETCH_TAIL, ("@ct.kernel(occupancy=2)\n", CHUNK_TILES.format(hint=hint))]
    return module_from(walk_source(), edits + ([] if store_tma else [ENTRY_STORE_NO_TMA]))


def hinted(latency):
    """The package's walk module with ``latency`` on every loop load (None: as it is)."""
    edits = [(before + after, f"{before}, latency={latency}{after}") for before, after in LOOP_LOADS] if latency else []
    return module_from(walk_source(), edits)


VARIANTS = {"package": lambda: hinted(None), "latency6": lambda: hinted(6), "latency10": lambda: hinted(10),
            "prefetch": lambda: prefetched(None), "prefetch_latency6": lambda: prefetched(6),
            # the entry state stored from registers: a TMA store goes through shared memory, which the
            # next chunk's store must wait to reuse
            "store_no_tma": lambda: module_from(walk_source(), [ENTRY_STORE_NO_TMA]),
            "prefetch_store_no_tma": lambda: prefetched(None, store_tma=False)}
# Experiment 61, on the walk as it is now (the variants above need git's history, a CPU or a
# device run with .git): the reverse walk's load of the following chunk's decay sums hinted as
# well, and the 2.7B layer's 320 blocks at 64 x 64 against 640 at 64 x 32 now that loads overlap.
NOW = {"now": lambda: module_from(CURRENT),
       "now_following6": lambda: module_from(CURRENT, [(
           "(batch, head, min(chunk + 1, num_chunks - 1)), (1, 1, chunk_size))",
           "(batch, head, min(chunk + 1, num_chunks - 1)), (1, 1, chunk_size), latency=6)")]),
       "now_half_tiles": lambda: module_from(CURRENT, [("FEW_BLOCKS = 264 ", "FEW_BLOCKS = 10 ** 9 ")]),
       # Experiment 62: the 2.7B layer's walk is 320 blocks where 264 fit at once (two per SM), so
       # its last 56 blocks run as a second wave: one wave from three blocks per SM, or from 160
       # blocks of 128 states.
       "now_occ3": lambda: module_from(CURRENT, [("@ct.kernel(occupancy=2)", "@ct.kernel(occupancy=3)")]),
       "now_occ4": lambda: module_from(CURRENT, [("@ct.kernel(occupancy=2)", "@ct.kernel(occupancy=4)")]),
       "now_occ3_half_tiles": lambda: module_from(CURRENT, [("@ct.kernel(occupancy=2)", "@ct.kernel(occupancy=3)"),
                                                            ("FEW_BLOCKS = 264 ", "FEW_BLOCKS = 10 ** 9 ")]),
       # The rule to adopt if occupancy 3 wins on the 2.7B only: three blocks per SM where two
       # per SM leave blocks for a second wave (as fwd_pass_state's wide tiles take occupancy 2).
       "now_occ3_when_crowded": lambda: module_from(CURRENT, [
           ("    has_init = init_state is not None\n    launch((batch * heads, tiles), chunk_states_walk_kernel,",
            "    has_init = init_state is not None\n    crowded = batch * heads * tiles > FEW_BLOCKS\n"
            "    launch((batch * heads, tiles), crowded_walk_kernel if crowded else chunk_states_walk_kernel,"),
           ("\n\ndef chunk_states_walk(",
            "\n\ncrowded_walk_kernel = chunk_states_walk_kernel.replace_hints(occupancy=3)\n\n\ndef chunk_states_walk(")]),
       "now_state128": lambda: module_from(CURRENT, [("state_tile = min(state_size, 64)",
                                                      "state_tile = min(state_size, 128)")])}
VARIANTS.update(NOW)
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
