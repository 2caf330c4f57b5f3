"""Experiment 53 (GPU): chunk_grads as two kernels, one per role of a token (sender: dx, ddt_input,
db; receiver: dc), against the joint kernel of ddc2f11 (chunk_grads_joint.py), timed as the whole
mamba2_chunk_backward on the issue's two shapes, the chunk_grads kernels' own GPU time from
torch.profiler, and each variant's gradients against the joint kernel's (fp32 sums in another
order).

    python3 benchmarks/variants/chunk_grads_split.py [B,T,G,H,N,P ...] [variant ...]
    python benchmarks/variants/chunk_grads_split.py --resources [variant ...]   (CPU: registers,
        spills and shared memory of each variant's kernels at the 2.7B layer's JIT signatures,
        kernel_remarks.py)
"""
import importlib.util
import pathlib
import sys
import tempfile

import torch

import tilegym_mamba2
from tilegym_mamba2.cutile import scan
from timing import backward_inputs, median_ms

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = HERE.parents[1] / "tilegym_mamba2" / "cutile" / "chunk_grads.py"
SHAPES = ("4,16384,1,8,128,64", "2,8192,1,80,128,64")
NAMES = ("grad_x", "grad_a", "grad_b", "grad_c", "grad_d", "grad_dt", "grad_init")


def module_from(path, edits=(), columns_edits=()):
    """The module at ``path`` with textual edits (each must apply once); ``columns_edits`` only
    in the text before the rows kernel (the package's columns kernel)."""
    text = path.read_text().replace("from .", "from tilegym_mamba2.cutile.")
    rows_at = text.index("@ct.kernel(occupancy=1)\ndef chunk_grads_rows_kernel") if columns_edits else len(text)
    columns, rest = text[:rows_at], text[rows_at:]
    for old, new in columns_edits:
        assert columns.count(old) == 1, f"{old!r} is not in {path.name}'s columns kernel once"
        columns = columns.replace(old, new)
    text = columns + rest
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} is not in {path.name} once"
        text = text.replace(old, new)
    copy = pathlib.Path(tempfile.mkdtemp()) / path.name
    copy.write_text(text)
    spec = importlib.util.spec_from_file_location(copy.stem, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The columns kernel on [s, t] tiles (sender s along the rows): its pairs' sums over t become row
# sums (run51: the column sums cost it 0.16 ms on the source config) and its two mma on
# transposed 64 x 64 tiles (dxs, db) take them as they are.
COLUMNS_ST = [
    ("""        b, c, seq_idx, batch, chunk, group, x.shape[1], chunk_size, state_size, has_seq)
""", """        b, c, seq_idx, batch, chunk, group, x.shape[1], chunk_size, state_size, has_seq)
    scores = ct.mma(b_tile, ct.transpose(c_tile), ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
    same = ct.transpose(same)
"""),
    ("ct.where(same, g[:, None] - g[None, :], never)", "ct.where(same, g[None, :] - g[:, None], never)"),
    ("ct.mma(dy_tile, ct.transpose(x_tile), ct.zeros(", "ct.mma(x_tile, ct.transpose(dy_tile), ct.zeros("),
    ("ct.mma(dy_low_tile, ct.transpose(x_tile), products)", "ct.mma(x_tile, ct.transpose(dy_low_tile), products)"),
    ("pairs = decayed_products * dt_tile[None, :] * scores", "pairs = decayed_products * dt_tile[:, None] * scores"),
    ("sent_pairs = ct.sum(pairs, axis=0)", "sent_pairs = ct.sum(pairs, axis=1)"),
    ("ct.mma(ct.transpose((decay * scores).astype(mma_dtype)), dy_tile,", "ct.mma((decay * scores).astype(mma_dtype), dy_tile,"),
    ("ct.mma(ct.transpose(decayed_products.astype(mma_dtype)), c_tile, db_head)",
     "ct.mma(decayed_products.astype(mma_dtype), c_tile, db_head)"),
]


VARIANTS = {
    "joint": lambda: module_from(HERE / "chunk_grads_joint.py"),
    "split": lambda: module_from(PACKAGE),
    "split_rows_occ2": lambda: module_from(PACKAGE, [(
        "@ct.kernel(occupancy=1)\ndef chunk_grads_rows_kernel", "@ct.kernel(occupancy=2)\ndef chunk_grads_rows_kernel")]),
    # A probe (dl wrong): what the fp32 dot <dS, S> costs the columns kernel. (run51's variant, dl's
    # pairs summed directly in the rows kernel, is chunk_grads.py at 31037c8.)
    "columns_st": lambda: module_from(PACKAGE, columns_edits=COLUMNS_ST),
    "probe_no_through": lambda: module_from(PACKAGE, [(
        "ct.exp2(g_end) * ct.sum(ct.sum(grad_t * state_t, axis=1), axis=0, keepdims=True)", "ct.exp2(g_end)")]),
}


def chunk_grads_ms(step):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.key.startswith("chunk_grads"):
            times[event.key.split("_kernel")[0]] = event.device_time_total / 5e3
    return times


def run(shape, names):
    inputs, dout, dfinal = backward_inputs(shape)

    def step():
        return tilegym_mamba2.mamba2_chunk_backward(**inputs, dout=dout, dfinal_state=dfinal)

    original = scan.chunk_grads_kernel
    want = None
    for name in names:
        scan.chunk_grads_kernel = VARIANTS[name]().chunk_grads
        got = step()
        want = want or got
        diffs = " ".join(f"{n} {((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item():.1e}"
                         for n, g, w in zip(NAMES, got, want) if w is not None and w.numel())
        nan = any(g is not None and not torch.isfinite(g.float()).all() for g in got)
        kernels = " ".join(f"{k} {v:.3f}" for k, v in chunk_grads_ms(step).items())
        print(f"{shape} {name:16s} backward {median_ms(step, reps=20):.3f} ms  [{kernels} ms]  "
              f"rel diff to joint: {diffs}{'  NaN/inf!' if nan else ''}", flush=True)
    scan.chunk_grads_kernel = original


def resources(names):
    from kernel_remarks import backward_launches, compile_and_report
    for name in names:
        scan.chunk_grads_kernel = VARIANTS[name]().chunk_grads
        launches = backward_launches((2, 8192, 1, 80, 128, 64))
        print(f"### {name}", flush=True)
        compile_and_report([(k, a) for k, a in launches if k._pyfunc.__name__.startswith("chunk_grads")])


if __name__ == "__main__":
    if "--resources" in sys.argv:
        resources([a for a in sys.argv[1:] if a in VARIANTS] or list(VARIANTS))
        sys.exit()
    shapes = [a for a in sys.argv[1:] if "," in a] or SHAPES
    names = [a for a in sys.argv[1:] if a in VARIANTS] or list(VARIANTS)
    for text in shapes:
        run(tuple(int(v) for v in text.split(",")), names)
