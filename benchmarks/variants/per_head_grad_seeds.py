"""Experiment 63's check (GPU): the gradients with one value per head (dA, dD, ddt_bias) are sums
over every token, so one seed's error is one draw. The mixer case of
tests/test_backward_gpu.py::test_layer_gradients_next_to_mamba_ssm over many seeds: each
gradient's error against float64, ours and (with --peer) mamba_ssm's, then the geometric mean and
range of each. Seeds are 1..N, so a run before and after a change sees the same inputs.

    python3 benchmarks/variants/per_head_grad_seeds.py [--seeds 32] [--peer] [--without-dy-low]
"""
import argparse
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
import tilegym_mamba2  # noqa: E402
from gpu_checks import rel_err  # noqa: E402
from test_backward_gpu import LAYER_OPTIONS, layer_case  # noqa: E402
from tilegym_mamba2.layer_reference import chunked_layer_reference, process_dt  # noqa: E402

NAMES = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias"]


def errors(seed, impls):
    x, dt_raw, A, B, C, kw, g = layer_case(LAYER_OPTIONS["mixer"], 2, 2048, 1, 8, 128, 64, torch.bfloat16, seed)
    tensors = [x, dt_raw, A, B, C, kw["D"], kw["z"], kw["dt_bias"]]
    dout = torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)
    ref_leaves = [t.detach().double().requires_grad_() for t in tensors]
    x64, dt64, A64, B64, C64, D64, z64, bias64 = ref_leaves
    dt = process_dt(dt64, bias64, True, kw["dt_limit"], dtype=torch.float64)
    out = chunked_layer_reference(x64, dt, A64, B64, C64, D64, z64, None, None, None, chunk_size=64)[0]
    refs = torch.autograd.grad((out * dout.double()).sum(), ref_leaves)
    found = {}
    for impl, fn in impls.items():
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        xl, dtl, Al, Bl, Cl, Dl, zl, biasl = leaves
        fn(xl, dtl, Al, Bl, Cl, 256, D=Dl, z=zl, dt_bias=biasl, dt_softplus=True,
           dt_limit=kw["dt_limit"]).backward(dout)
        found[impl] = {n: rel_err(t.grad, r) for n, t, r in zip(NAMES, leaves, refs)}
    return found


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--peer", action="store_true", help="mamba_ssm's gradients as well")
    parser.add_argument("--without-dy-low", action="store_true",
                        help="ours with the gated dy rounded once to bf16 for every use, as mamba_ssm does "
                             "(no dy_low: experiment 48's split undone), to see which gradients the split moves")
    args = parser.parse_args()
    if args.without_dy_low:
        from tilegym_mamba2 import backward
        with_split = backward.scan_backward
        backward.scan_backward = lambda *a, dy_low=None, **k: with_split(*a, **k)
    impls = {"ours": tilegym_mamba2.mamba_chunk_scan_combined}
    if args.peer:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        impls["mamba_ssm"] = mamba_chunk_scan_combined
    table = {impl: {n: [] for n in NAMES} for impl in impls}
    for seed in range(1, args.seeds + 1):
        found = errors(seed, impls)
        for impl, errs in found.items():
            print(f"seed={seed} {impl:9s} " + " ".join(f"d{n}={e:.2e}" for n, e in errs.items()), flush=True)
            for n, e in errs.items():
                table[impl][n].append(e)
    for impl, cols in table.items():
        for n, es in cols.items():
            geo = math.exp(sum(math.log(e) for e in es) / len(es))
            print(f"summary {impl:9s} d{n:8s} geomean {geo:.2e}  min {min(es):.2e}  max {max(es):.2e}")


if __name__ == "__main__":
    main()
