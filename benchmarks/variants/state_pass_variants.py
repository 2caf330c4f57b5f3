"""Scratch experiment (GPU): the state pass (segment_states_kernel + state_scan_kernel) over its
tile sizes and the segment-state kernel's occupancy hint, timed alone at each shape's tuned config.

    source .device/setup.sh && python3 benchmarks/variants/state_pass_variants.py

The package on main runs 64 x 64 state tiles at occupancy 4 (128 registers, 24 spill stores in the sm_90
cubin). A 128-row state tile at N=128 loads each x tile once instead of twice and doubles the
mma's M (16 HGMMA instead of 8; 255 registers, 5 spill stores, at occupancy 1 or 2). Every
variant writes into NaN-poisoned buffers and is compared with the package's entry and final
states (NOTES.md, open questions).
"""
import importlib
from dataclasses import replace

import torch

from tilegym_mamba2.cutile.launch import poisoned_outputs
from compute_out_variants import median_ms, tuned_inputs

# The module, not the function of the same name that tilegym_mamba2.cutile exports.
state_pass = importlib.import_module("tilegym_mamba2.cutile.fwd_pass_state")

PACKAGE_KERNEL = state_pass.segment_states_kernel


def run(shape):
    args, tuned, dt_bht, g = tuned_inputs(shape)
    x, a, b, c, d, dt, init, chunk = args
    state_pass.segment_states_kernel = PACKAGE_KERNEL
    ref_entry, ref_final = state_pass.fwd_pass_state(x, b, dt_bht, g, init, tuned.chunk_size, tuned)
    state_size, head_size = b.shape[3], x.shape[3]
    results = []
    for state_tile in sorted({64, min(state_size, 128), state_size}):
        for head_tile in sorted({min(head_size, 64), head_size}):
            for occupancy in (4, 2, 1):
                cfg = replace(tuned, state_tile=state_tile, state_head_tile=head_tile)
                state_pass.segment_states_kernel = PACKAGE_KERNEL.replace_hints(occupancy=occupancy)
                try:
                    with poisoned_outputs():
                        entry, final = state_pass.fwd_pass_state(x, b, dt_bht, g, init, cfg.chunk_size, cfg)
                    same = torch.equal(entry, ref_entry) and torch.equal(final, ref_final)
                    close = ((final - ref_final).norm() / ref_final.norm()).item()
                    ms = median_ms(lambda: state_pass.fwd_pass_state(x, b, dt_bht, g, init, cfg.chunk_size, cfg))
                    results.append(f"N{state_tile}xP{head_tile} occ{occupancy} {ms:.3f} ms "
                                   f"({'same bits' if same else f'final diff {close:.1e}'})")
                except Exception as e:  # a variant that does not compile is a result too
                    results.append(f"N{state_tile}xP{head_tile} occ{occupancy} FAILED {type(e).__name__}: {str(e)[:120]}")
    state_pass.segment_states_kernel = PACKAGE_KERNEL
    print(f"{str(shape):28s} tuned {tuned.chunks_per_segment} chunks/segment\n    " + "\n    ".join(results),
          flush=True)


if __name__ == "__main__":
    for shape in [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (4, 65536, 1, 8, 128, 64),
                  (2, 8192, 8, 64, 256, 64), (8, 4096, 1, 32, 64, 128)]:
        run(shape)
