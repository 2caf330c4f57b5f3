"""Scratch experiment (GPU): the state pass (segment_states_kernel + state_scan_kernel) over its
tile sizes and the segment-state kernel's occupancy hint, timed alone at each shape's tuned config.

    source .device/setup.sh && python3 benchmarks/variants/state_pass_variants.py

Experiment 15 (run7) and 19 (run10) measured these choices; the package now runs 64 x 64 tiles
at occupancy 4 at N=128 and whole-state tiles at occupancy 2 elsewhere (tuning.py). Each
variant below sets one occupancy for both of fwd_pass_state's segment-state kernels. Every
variant writes into NaN-poisoned buffers and is compared with the package's entry and final
states.
"""
import importlib
from dataclasses import replace

import torch

from tilegym_mamba2.cutile.launch import poisoned_outputs
from timing import median_ms, tuned_inputs

# The module, not the function of the same name that tilegym_mamba2.cutile exports.
state_pass = importlib.import_module("tilegym_mamba2.cutile.fwd_pass_state")

PACKAGE_KERNELS = state_pass.segment_states_kernel, state_pass.wide_segment_states_kernel


def use_kernels(narrow, wide):
    state_pass.segment_states_kernel, state_pass.wide_segment_states_kernel = narrow, wide


def run(shape):
    args, tuned, dt_bht, g = tuned_inputs(shape)
    x, a, b, c, d, dt, init, chunk = args
    use_kernels(*PACKAGE_KERNELS)
    ref_entry, ref_final = state_pass.fwd_pass_state(x, b, dt_bht, g, init, tuned.chunk_size, tuned)
    state_size, head_size = b.shape[3], x.shape[3]
    results = []
    for state_tile in sorted({64, min(state_size, 128), state_size}):
        for head_tile in sorted({min(head_size, 64), head_size}):
            for occupancy in (4, 2, 1):
                cfg = replace(tuned, state_tile=state_tile, state_head_tile=head_tile)
                hinted = PACKAGE_KERNELS[0].replace_hints(occupancy=occupancy)
                use_kernels(hinted, hinted)
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
    use_kernels(*PACKAGE_KERNELS)
    print(f"{str(shape):28s} tuned {tuned.chunks_per_segment} chunks/segment\n    " + "\n    ".join(results),
          flush=True)


if __name__ == "__main__":
    for shape in [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (4, 65536, 1, 8, 128, 64),
                  (2, 8192, 8, 64, 256, 64), (8, 4096, 1, 32, 64, 128)]:
        run(shape)
