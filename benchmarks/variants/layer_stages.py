"""Scratch (GPU): where the layer op's time goes on packed sequences (bench --layer's
"packed, 64 sequences", ours 1.64 ms against 0.66 ms for the plain op's stages on the same bucket).

    python3 benchmarks/variants/layer_stages.py

Per segment length (chunks_per_segment): the layer op's stages without varlen states, with
them, and the varlen-state kernel alone; plus the argument checks alone. CUDA-event medians.
"""
from dataclasses import replace

import torch

from tilegym_mamba2.bench_layer import LAYER_CASES, layer_inputs
from tilegym_mamba2.cutile import config_for
from tilegym_mamba2.cutile.scan_combined import run_layer
from tilegym_mamba2.cutile.varlen_states import varlen_states
from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
from tilegym_mamba2.cutile.fwd_pass_state import fwd_pass_state
from tilegym_mamba2.validation import check_scan_combined_args
from timing import median_ms


def main():
    for case in LAYER_CASES[2:]:
        kwargs, lengths = layer_inputs(case)
        args = check_scan_combined_args(chunk_size=256, **kwargs, backend="cutile")
        x, dt, A, B, C, chunk_size, D, z, dt_bias, init, seq_idx, cu_seqlens, softplus, limit = args[:14]
        tuned = config_for(x, A, B, C, None, dt, None, chunk_size)
        checks = median_ms(lambda: check_scan_combined_args(chunk_size=256, **kwargs, backend="cutile"))
        print(f"{case.name}: tuned {tuned}; argument checks {checks:.3f} ms", flush=True)
        for cps in (4, 8, 16, 32):
            cfg = replace(tuned, chunks_per_segment=cps)
            no_varlen = median_ms(lambda: run_layer(*args[:14], with_varlen_states=False, config=cfg))
            with_varlen = median_ms(lambda: run_layer(*args[:14], with_varlen_states=True, config=cfg))
            seq = seq_idx.to(torch.int32)
            dt_bht, g = chunk_cumsum(dt, A, cfg.chunk_size, dt_bias=dt_bias, softplus=softplus, dt_limit=limit)
            entry, _ = fwd_pass_state(x, B, dt_bht, g, None, cfg.chunk_size, cfg, seq_idx=seq)
            cu = cu_seqlens.to(torch.int32)
            alone = median_ms(lambda: varlen_states(x, B, dt_bht, g, seq, cu, entry, cfg.chunk_size, cfg,
                                                    dtype=torch.float32))
            print(f"  chunks_per_segment {cps:2d}: stages {no_varlen:.3f} ms, with varlen states {with_varlen:.3f} ms, "
                  f"varlen kernel alone {alone:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
