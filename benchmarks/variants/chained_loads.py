"""Experiment 80 (CPU: compiles for sm_90; GPU: --time): the chained kernel's staged sums loaded
without TMA, in forms that might compile as well as the TMA loads do.

Experiment 79: loading the staged dt and decay sums in the outputs' phase through TMA compiles to
168 registers and 192 bytes of stack (kernel 0.046 ms at the prefill) but made the final state
vary between repeated calls; ordinary loads of the same (1, 1, 1, chunk) tiles, reshaped to one
dimension, compile to 255 registers and 392 bytes of stack (0.076 ms). The one-dimensional tile
is then broadcast both ways (g[:, None] - g[None, :], dt[None, :], (dt * ...)[:, None]), which
a register layout serves badly. Forms, each the package's kernel with the outputs' phase edited
(written next to the package module and imported from there, removed after):
  ordinary  the package as it is
  tma       the sums loaded through TMA (experiment 79's fast, nondeterministic form)
  pair      one ordinary (2, 1, 1, chunk) load of dt and the sums together, rows extracted
  shaped    ordinary loads straight into the shapes the arithmetic uses: a row and a column of
            each, so no one-dimensional tile is broadcast
Default (CPU): each compiled for sm_90 at the prefill's launch; registers, stack, shared memory.
--time (GPU): each checked against "ordinary" to the bit over repeats with poisoned outputs, and
its GPU time per call in graph replay.
"""
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import tilegym_mamba2.cutile as cutile_package  # noqa: E402
from tilegym_mamba2.cutile.launch import recording_launches  # noqa: E402
from tilegym_mamba2.cutile.tuning import chained_config, choose_config  # noqa: E402

PACKAGE = os.path.join(os.path.dirname(cutile_package.__file__), "chained_prefill.py")
ORDINARY = '''        dt_tile = ct.load(sums, (0, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape(
            (chunk_size,))
        g = ct.load(sums, (1, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape((chunk_size,))
'''
TMA = '''        dt_tile = ct.load(sums, (0, batch, head, chunk), (1, 1, 1, chunk_size)).reshape((chunk_size,))
        g = ct.load(sums, (1, batch, head, chunk), (1, 1, 1, chunk_size)).reshape((chunk_size,))
'''
PAIR = '''        both = ct.load(sums, (0, batch, head, chunk), (2, 1, 1, chunk_size), allow_tma=False).reshape(
            (2, chunk_size))
        dt_tile = ct.extract(both, (0, 0), (1, chunk_size)).reshape((chunk_size,))
        g = ct.extract(both, (1, 0), (1, chunk_size)).reshape((chunk_size,))
'''
BODY_START = "        g_last = ct.extract(g, (chunk_size - 1,), (1,))\n        c_b = ct.mma("
SHAPED_BODY = '''        g_col = ct.load(sums, (1, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape(
            (chunk_size, 1))
        g_row = ct.load(sums, (1, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape(
            (1, chunk_size))
        dt_col = ct.load(sums, (0, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape(
            (chunk_size, 1))
        dt_row = ct.load(sums, (0, batch, head, chunk), (1, 1, 1, chunk_size), allow_tma=False).reshape(
            (1, chunk_size))
        g_last = ct.extract(g_row, (0, chunk_size - 1), (1, 1))
        c_b = ct.mma(c_tile.astype(mma_dtype), ct.transpose(b_tile.astype(mma_dtype)),
                     ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        decay = ct.exp2(ct.where(causal, g_col - g_row, never))
        weights = (c_b * decay * dt_row).astype(mma_dtype)
        y = ct.mma(weights, x_tile.astype(mma_dtype), ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        c_decayed = (c_tile.astype(ct.float32) * ct.exp2(g_col)).astype(mma_dtype)
        y = ct.mma(c_decayed, ct.transpose(state.astype(mma_dtype)), y)
        y = y + skip * x_tile.astype(ct.float32)
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))
        weighted_b = (b_tile.astype(ct.float32) * (dt_col * ct.exp2(g_last - g_col))).astype(mma_dtype)
        state = ct.mma(ct.transpose(x_tile.astype(mma_dtype)), weighted_b, state * ct.exp2(g_last))
'''


def forms(source: str) -> dict:
    assert source.count(ORDINARY) == 1, "the package's sums loads changed"
    start = source.index(ORDINARY)
    body_end = source.index("\n\n\nclass Workspace")
    assert source.count(BODY_START) == 1
    return {"ordinary": source,
            "tma": source.replace(ORDINARY, TMA),
            "pair": source.replace(ORDINARY, PAIR),
            "shaped": source[:start] + SHAPED_BODY.rstrip("\n") + source[body_end:]}


def load_form(name: str, text: str):
    module = "_loads_" + name
    with open(os.path.join(os.path.dirname(PACKAGE), module + ".py"), "w") as f:
        f.write(text)
    return importlib.import_module("tilegym_mamba2.cutile." + module)


def remove_forms(names):
    for name in names:
        os.remove(os.path.join(os.path.dirname(PACKAGE), f"_loads_{name}.py"))


def compile_forms():
    from kernel_remarks import compile_and_report  # this folder's
    modules = {name: load_form(name, text) for name, text in forms(open(PACKAGE).read()).items()}
    x = torch.zeros(1, 2048, 32, 64, dtype=torch.bfloat16)
    b = torch.zeros(1, 2048, 1, 128, dtype=torch.bfloat16)
    config = chained_config(choose_config(1, 2048, 1, 32, 64, 128, 128), 4)
    try:
        for name, module in modules.items():
            print(f"## {name}", flush=True)
            with recording_launches() as launches:
                module.chained_prefill(x, torch.zeros(32), b, b.clone(), torch.zeros(32), torch.zeros(1, 2048, 32),
                                       torch.zeros(1, 32, 64, 128), config)
            compile_and_report(launches)
    finally:
        remove_forms(modules)


def time_forms(calls=int(os.environ.get("CALLS", 30))):
    from timing import graph_us  # this folder's
    from tilegym_mamba2.cutile.launch import poisoned_outputs
    from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
    from tilegym_mamba2.validation import check_forward_args
    modules = {name: load_form(name, text) for name, text in forms(open(PACKAGE).read()).items()}
    spec = Mamba2ProblemSpec.from_shape((1, 2048, 1, 32, 128, 64), chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    config = chained_config(choose_config(1, 2048, 1, 32, 64, 128, 128), 4)
    try:
        with poisoned_outputs():
            want = modules["ordinary"].chained_prefill(*args[:7], config)
            for name, module in modules.items():
                differ = 0
                for _ in range(calls):
                    got = module.chained_prefill(*args[:7], config)
                    differ += not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
                ms = statistics.median(graph_us([lambda: module.chained_prefill(*args[:7], config)] * 20) / 1e3
                                       for _ in range(3))
                print(f"{name:10s} calls differing from 'ordinary' (poisoned outputs): {differ} of {calls}  "
                      f"graph ms {ms:.4f}", flush=True)
    finally:
        remove_forms(modules)


if __name__ == "__main__":
    time_forms() if "--time" in sys.argv else compile_forms()
