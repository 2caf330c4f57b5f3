"""Experiment 53 (GPU): chunk_grads as two kernels, one per role of a token (sender: dx, ddt_input,
db; receiver: dc), against the joint kernel of ddc2f11 (chunk_grads_joint.py), timed as the whole
mamba2_chunk_backward on the issue's two shapes, the chunk_grads kernels' own GPU time from
torch.profiler, and each variant's gradients against the joint kernel's (fp32 sums in another
order).

    python3 benchmarks/variants/chunk_grads_split.py [--float32] [B,T,G,H,N,P ...] [variant ...]
    python benchmarks/variants/chunk_grads_split.py --resources [B,T,G,H,N,P ...] [variant ...]
        (CPU: registers, spills and shared memory of each variant's kernels at the JIT's
        signatures, kernel_remarks.py; the 2.7B layer's unless shapes are given)
"""
import pathlib
import sys

import torch

import tilegym_mamba2
from edited import module_from  # this folder's
from tilegym_mamba2.cutile import scan
from timing import backward_inputs, median_ms

HERE = pathlib.Path(__file__).resolve().parent
PACKAGE = HERE.parents[1] / "tilegym_mamba2" / "cutile" / "chunk_grads.py"
SHAPES = ("4,16384,1,8,128,64", "2,8192,1,80,128,64")
# Experiment 66 put both kernels at occupancy 2 (the package since the eighteenth session); these
# put them back at 1, as in run50-run70.
ROWS_OCC1 = ("@ct.kernel(occupancy=2)\ndef chunk_grads_rows_kernel", "@ct.kernel(occupancy=1)\ndef chunk_grads_rows_kernel")
COLUMNS_OCC1 = ("@ct.kernel(occupancy=2)\ndef chunk_grads_columns_kernel",
                "@ct.kernel(occupancy=1)\ndef chunk_grads_columns_kernel")
NAMES = ("grad_x", "grad_a", "grad_b", "grad_c", "grad_d", "grad_dt", "grad_init")


VARIANTS = {
    "joint": lambda: module_from(HERE / "chunk_grads_joint.py"),
    "split": lambda: module_from(PACKAGE),
    # Experiment 66: with 16-bit chunk states (experiment 63) both kernels compile at occupancy 2
    # to two blocks per SM for state <= 128, head 64 (128 registers, 114 / 89 KB, no more stack):
    # 1.2-1.25x on the backward (run71); run50's rows kernel at occupancy 2 was 1.8x slower with
    # fp32 states, which fp32 inputs still have (--float32 times them).
    "split_occ1": lambda: module_from(PACKAGE, [COLUMNS_OCC1, ROWS_OCC1]),
    "split_rows_occ1": lambda: module_from(PACKAGE, [ROWS_OCC1]),
    "split_columns_occ1": lambda: module_from(PACKAGE, [COLUMNS_OCC1]),
    # A probe (dl wrong): what the fp32 dot <dS, S> costs the columns kernel. (run51's variant, dl's
    # pairs summed directly in the rows kernel, is chunk_grads.py at 31037c8; the columns kernel
    # on [t, s] tiles, timed against the package's [s, t] one in run53, is chunk_grads.py at d901859.)
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


def run(shape, names, dtype):
    inputs, dout, dfinal = backward_inputs(shape, dtype)

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
        print(f"{shape} {str(dtype)[6:]} {name:16s} backward {median_ms(step, reps=20):.3f} ms  [{kernels} ms]  "
              f"rel diff to joint: {diffs}{'  NaN/inf!' if nan else ''}", flush=True)
    scan.chunk_grads_kernel = original


def resources(names, shapes):
    from kernel_remarks import backward_launches, compile_and_report
    for shape in shapes:
        for name in names:
            scan.chunk_grads_kernel = VARIANTS[name]().chunk_grads
            launches = backward_launches(shape)
            print(f"### {shape} {name}", flush=True)
            compile_and_report([(k, a) for k, a in launches if k._pyfunc.__name__.startswith("chunk_grads")])


if __name__ == "__main__":
    shapes = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:] if "," in a]
    names = [a for a in sys.argv[1:] if a in VARIANTS] or list(VARIANTS)
    if "--resources" in sys.argv:
        resources(names, shapes or [(2, 8192, 1, 80, 128, 64)])
        sys.exit()
    for shape in shapes or [tuple(int(v) for v in text.split(",")) for text in SHAPES]:
        run(shape, names, torch.float32 if "--float32" in sys.argv else torch.bfloat16)
