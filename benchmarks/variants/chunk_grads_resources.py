"""CPU (no GPU): what shared memory, registers and spills variants of chunk_grads_kernel compile to
for sm_90 (experiment 52), on the 2.7B layer's shape with the JIT's signatures (kernel_remarks.py).

The package's chunk_grads takes 227,744 bytes of shared memory per block, nearly all of an H200
SM's 228 KB, so one block (4 warps) runs per SM; it also spills (a 496-byte stack frame per
thread). Each variant here is the package's kernel source with textual edits (each must apply),
loaded as a module of its own and compiled through its own `_compile`:

    package        as it is
    states_no_tma  the two state tiles loaded without TMA (allow_tma=False)
    loop_no_tma    every load inside the head loop without TMA
    low_latency    the loads inside the head loop with latency=1 (a hint that DRAM traffic is light)
    bf16_states    both state sets read as bf16 (the walks would store them so: half their bytes),
                   widened to fp32 on load where fp32 math reads them
    occupancy2     the kernel's occupancy hint at 2
    warps8         num_worker_warps=8 (twice the warps of one block to hide latency with)
    through_sliced the fp32 state dot <dS, S> (the `through` term of dl) from 32-row slices of
                   both states loaded again (from L2) instead of the two whole tiles, so that
                   neither whole fp32 tile has to stay resident for it (probe_no_through's
                   finding)
Attribution probes (wrong results; only what a piece of the kernel costs in resources):
    probe_no_pairs the dl term from pairs within the chunk left out (its 64 x 64 fp32 cumsum
                   along the rows and masked column sums)
    probe_no_db    db left out (its transposed 64 x 64 operand and two mma)
    probe_no_through  the fp32 state dot <dS, S> left out

    python benchmarks/variants/chunk_grads_resources.py [variant ...]

A variant that fits two blocks per SM (<= ~113 KB of shared memory, no spills) is one to time on
the device with the whole backward (variants/chunk_grads_blocks.py's harness).
"""
import pathlib
import sys

import torch

from edited import module_from  # this folder's
from kernel_remarks import backward_launches, compile_and_report
from tilegym_mamba2.cutile import scan

# The one-kernel chunk_grads of experiment 52 (the package splits it in two since experiment 53).
SOURCE = pathlib.Path(__file__).resolve().parent / "chunk_grads_joint.py"
LOOP_LOADS = ("x_tile = ct.load(x, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),\n",
              "dy_tile = ct.load(dy, (batch, chunk, head, 0), (1, chunk_size, 1, head_size),\n",
              "state_t = ct.load(entry_states, (batch, head, chunk, 0), (1, 1, state_size, head_size))",
              "grad_t = ct.load(rev_entry_states, (batch, head, reversed_chunk, 0), (1, 1, state_size, head_size))")
STATE_LOADS = LOOP_LOADS[2:]


def with_keyword(load: str, keyword: str) -> tuple:
    """(load, the load with ``keyword`` after its shape argument)."""
    if load.endswith(",\n"):
        return load, f"{load[:-2]}, {keyword},\n"
    return load, f"{load[:-1]}, {keyword})"


EDITS = {
    "package": [],
    "states_no_tma": [with_keyword(load, "allow_tma=False") for load in STATE_LOADS],
    "loop_no_tma": [with_keyword(load, "allow_tma=False") for load in LOOP_LOADS],
    "low_latency": [with_keyword(load, "latency=1") for load in LOOP_LOADS],
    "bf16_states": [(".reshape(\n            (state_size, head_size))\n",
                     ".reshape(\n            (state_size, head_size)).astype(ct.float32)\n"),
                    ("(1, 1, state_size, head_size)).reshape(\n            (state_size, head_size)) * into_next",
                     "(1, 1, state_size, head_size)).reshape(\n            (state_size, head_size)).astype(ct.float32)"
                     " * into_next")],
    "occupancy2": [("@ct.kernel(occupancy=1)", "@ct.kernel(occupancy=2)")],
    "warps8": [("@ct.kernel(occupancy=1)", "@ct.kernel(occupancy=1, num_worker_warps=8)")],
    "through_sliced": [("""        through = ct.exp2(g_end) * ct.sum(ct.sum(grad_t * state_t, axis=1), axis=0, keepdims=True)""",
                        """        dot = ct.zeros((1,), dtype=ct.float32)
        for r in range(state_size // 32):
            s_part = ct.load(entry_states, (batch, head, chunk * (state_size // 32) + r, 0),
                             (1, 1, 32, head_size)).reshape((32, head_size))
            g_part = ct.load(rev_entry_states, (batch, head, reversed_chunk * (state_size // 32) + r, 0),
                             (1, 1, 32, head_size)).reshape((32, head_size))
            dot = dot + ct.sum(ct.sum(g_part * s_part, axis=1), axis=0, keepdims=True)
        through = ct.exp2(g_end) * into_next * dot""")],
    "probe_no_pairs": [("""        before_u = ct.cumsum(pairs, axis=1) - pairs
        dl_tile = ct.sum(ct.where(at_or_before, before_u, 0.0), axis=0)""",
                        """        dl_tile = ct.zeros((chunk_size,), dtype=ct.float32)""")],
    "probe_no_db": [("        db_sum = db_sum + db_head\n", "")],
    "probe_no_through": [("ct.exp2(g_end) * ct.sum(ct.sum(grad_t * state_t, axis=1), axis=0, keepdims=True)",
                          "ct.exp2(g_end)")],
}


def variant_module(name):
    return module_from(SOURCE, EDITS[name], stem=f"chunk_grads_{name}")


scan.chunk_grads_kernel = variant_module("package").chunk_grads
launches = backward_launches((2, 8192, 1, 80, 128, 64))
kernel, args = next((k, a) for k, a in launches if k._pyfunc.__name__ == "chunk_grads_kernel")
for name in sys.argv[1:] or EDITS:
    print(f"### {name}", flush=True)
    variant_args = list(args)
    if name == "bf16_states":
        variant_args[7:9] = [t.to(torch.bfloat16) for t in args[7:9]]
    compile_and_report([(variant_module(name).chunk_grads_kernel, tuple(variant_args))])
