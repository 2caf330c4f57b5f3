"""Scratch experiment (GPU): the working tree's state pass and compute_out against a baseline
copy of the same modules, each stage timed alone on the same inputs, in one process.

    mkdir -p benchmarks/variants/_baseline   # untracked; filled from the commit to compare with:
    git show main:tilegym_mamba2/cutile/compute_out.py > benchmarks/variants/_baseline/compute_out.py
    git show main:tilegym_mamba2/cutile/fwd_pass_state.py > benchmarks/variants/_baseline/fwd_pass_state.py
    source .device/setup.sh && python3 benchmarks/variants/ab_stages.py

Also times the new kernels at other occupancy hints and state-pass tile sizes, and the scan
kernel alone at narrower tiles. Outputs are compared with the baseline's (relative norm).
"""
import importlib
import importlib.util
import os
import sys
from dataclasses import replace

import torch

from tilegym_mamba2.cutile.launch import launch, poisoned_outputs
from timing import median_ms, tuned_inputs

state_pass = importlib.import_module("tilegym_mamba2.cutile.fwd_pass_state")
output_stage = importlib.import_module("tilegym_mamba2.cutile.compute_out")


def baseline(name):
    """The baseline file loaded as a sibling module, so its relative imports resolve."""
    path = os.path.join(os.path.dirname(__file__), "_baseline", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"tilegym_mamba2.cutile._baseline_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(shape, old_pass, old_out):
    args, cfg, dt_bht, g = tuned_inputs(shape)
    x, a, b, c, d, dt, init, _ = args
    rows = [f"{shape} config {cfg}"]

    def timed(label, fn, ref=None):
        try:
            with poisoned_outputs():
                result = fn()
            first = result[0] if isinstance(result, tuple) else result
            diff = "" if ref is None else f" diff {rel(first, ref):.1e}" + (" NaN!" if first.isnan().any() else "")
            rows.append(f"  {label:44s} {median_ms(fn):.4f} ms{diff}")
            return first
        except Exception as e:  # a variant that does not compile is a result too
            rows.append(f"  {label:44s} FAILED {type(e).__name__}: {str(e)[:150]}")

    pass_args = (x, b, dt_bht, g, init, cfg.chunk_size)
    state_size, head_size = b.shape[3], x.shape[3]
    # The baseline with the tiles it chose itself (64 x 64 at most), the working tree with its own.
    old_cfg = replace(cfg, state_tile=min(state_size, 64), state_head_tile=min(head_size, 64))
    entry_old = timed("state pass, baseline", lambda: old_pass.fwd_pass_state(*pass_args, old_cfg))
    timed(f"state pass, new ({cfg.state_tile} x {cfg.state_head_tile})",
          lambda: state_pass.fwd_pass_state(*pass_args, cfg), entry_old)
    kernels = state_pass.segment_states_kernel, state_pass.wide_segment_states_kernel
    for tile, head_tile in sorted({(64, 64), (min(state_size, 128), 64), (state_size, 64),
                                   (min(state_size, 64), 128)}):
        if head_tile > head_size:
            continue
        for occupancy in (4, 2):
            hinted = kernels[0].replace_hints(occupancy=occupancy)
            state_pass.segment_states_kernel = state_pass.wide_segment_states_kernel = hinted
            t = replace(cfg, state_tile=tile, state_head_tile=head_tile)
            timed(f"state pass, new, tile {tile} x {head_tile} occ {occupancy}",
                  lambda: state_pass.fwd_pass_state(*pass_args, t), entry_old)
    state_pass.segment_states_kernel, state_pass.wide_segment_states_kernel = kernels

    # The scan alone: narrower tiles give more blocks for the same serial walk over segments.
    entry, _ = state_pass.fwd_pass_state(*pass_args, cfg)
    local, segments = entry.clone(), entry.shape[2]
    decay = torch.zeros(x.shape[0], x.shape[2], segments, device=x.device)
    final = torch.empty(x.shape[0], x.shape[2], head_size, state_size, device=x.device)
    for hp, np_ in ((64, 64), (64, 32), (32, 32), (64, 16)):
        if hp > head_size or np_ > state_size:
            continue
        grid = (x.shape[0] * x.shape[2], (head_size // hp) * (state_size // np_))
        timed(f"scan alone, baseline, tile {np_}x{hp}", lambda: launch(grid, old_pass.state_scan_kernel, (
            local, decay, final if init is None else init, decay, entry, final, init is not None, hp, np_,
            False)) or entry)
        timed(f"scan alone, tile {np_}x{hp}", lambda: launch(grid, state_pass.state_scan_kernel, (
            local, decay, final if init is None else init, decay, entry, final, init is not None, hp, np_,
            False)) or entry)

    out_args = (x, b, c, d, dt_bht, g, entry_old, cfg.chunk_size)
    out_old = timed("compute_out, baseline", lambda: old_out.compute_out(*out_args, cfg))
    new_kernel = output_stage.compute_out_kernel
    for occupancy in (2, 1, 3):
        output_stage.compute_out_kernel = new_kernel.replace_hints(occupancy=occupancy)
        timed(f"compute_out, new, occ {occupancy}", lambda: output_stage.compute_out(*out_args, cfg), out_old)
    output_stage.compute_out_kernel = new_kernel
    flipped = replace(cfg, group_scores=not cfg.group_scores)
    timed(f"compute_out, new, group_scores={flipped.group_scores}",
          lambda: output_stage.compute_out(*out_args, flipped), out_old)
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    old_pass, old_out = baseline("fwd_pass_state"), baseline("compute_out")
    shapes = [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (4, 65536, 1, 8, 128, 64),
              (2, 8192, 8, 64, 256, 64), (8, 4096, 1, 32, 64, 128), (1, 2048, 1, 32, 128, 64)]
    for shape in shapes[:int(sys.argv[1]) if len(sys.argv) > 1 else None]:
        run(shape, old_pass, old_out)
