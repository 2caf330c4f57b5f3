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
import sys

import torch

from chunk_grads_split import module_from  # this folder's
from tilegym_mamba2.cutile import scan

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = HERE.parents[1] / "tilegym_mamba2" / "cutile" / "chunk_states_walk.py"
SHAPES = ("4,16384,1,8,128,64", "2,8192,1,80,128,64")
LOOP_LOADS = (  # (text before the hint, text after it) of each load inside the loop
    ("x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),\n"
     "                         padding_mode=ct.PaddingMode.ZERO", ")"),
    ("b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),\n"
     "                      padding_mode=ct.PaddingMode.ZERO", ")"),
    ("g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)", ")"),
    ("dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)", ")"),
)


def hinted(latency):
    """The package's walk module with ``latency`` on every loop load (None: as it is)."""
    edits = [(before + after, f"{before}, latency={latency}{after}") for before, after in LOOP_LOADS] if latency else []
    return module_from(PACKAGE, edits)


VARIANTS = {"package": None, "latency1": 1, "latency3": 3, "latency6": 6, "latency10": 10}


def walk_inputs(shape):
    from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
    from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=64, device="cuda")
    i = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    dt_bht, decay_cumsum = chunk_cumsum(i["dt"], i["a"], 64)
    return i, dt_bht, decay_cumsum, torch.randn_like(i["x"]), torch.randn_like(i["init_state"])


def run(shape, names):
    from timing import median_ms  # this folder's (GPU)
    i, dt_bht, decay_cumsum, dy, dfinal = walk_inputs(shape)
    want = None
    for name in names:
        walk = hinted(VARIANTS[name]).chunk_states_walk
        calls = {"forward": lambda: walk(i["x"], i["b"], dt_bht, decay_cumsum, i["init_state"], 64),
                 "reverse": lambda: walk(dy, i["c"], decay_cumsum, decay_cumsum, dfinal, 64, reverse=True)}
        got = [t.clone() for call in calls.values() for t in call()]
        want = want or got
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        times = "  ".join(f"{k} {median_ms(call):.3f} ms" for k, call in calls.items())
        print(f"{shape} {name:10s} {times}  {'same bits as ' + names[0] if same else 'BITS DIFFER'}", flush=True)


def resources(names):
    from kernel_remarks import backward_launches, compile_and_report
    original = scan.chunk_states_walk
    for name in names:
        scan.chunk_states_walk = hinted(VARIANTS[name]).chunk_states_walk
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
