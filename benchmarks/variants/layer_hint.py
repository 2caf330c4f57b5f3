"""Scratch (GPU): does the layer op keep the plain op's gain from compute_out's load-latency
hint (NOTES.md, experiment 24)? Each layer-benchmark case runs the layer op (every option its
case uses) at the heuristic config (its varlen states too where it packs sequences) with ``out_load_latency`` 1 and 0, alternating rounds of
back-to-back calls (host time not counted), and checks that both give the same bits.

    cd benchmarks/variants && python3 layer_hint.py
"""
import statistics
from dataclasses import replace

import torch

from tilegym_mamba2.bench_layer import LAYER_CASES, layer_inputs
from tilegym_mamba2.cutile.scan_combined import run_layer
from tilegym_mamba2.cutile.tuning import choose_config
from tilegym_mamba2.validation import check_scan_combined_args
from timing import queued_ms


def main():
    for case in LAYER_CASES:
        kwargs, _ = layer_inputs(case)
        args = check_scan_combined_args(chunk_size=256, **kwargs, backend="cutile")[:14]
        x, b = args[0], args[3]
        batch, tokens, heads, head_size = x.shape
        base = choose_config(batch, tokens, b.shape[2], heads, head_size, b.shape[3], args[5], x.device)
        configs = {hint: replace(base, out_load_latency=hint) for hint in (1, 0)}
        varlen = args[11] is not None  # cu_seqlens: the benchmark asks for the varlen states
        outs = {hint: run_layer(*args, with_varlen_states=varlen, config=config) for hint, config in configs.items()}
        same = all(torch.equal(p, q) for p, q in zip(_tensors(outs[1]), _tensors(outs[0])))
        times = {hint: [] for hint in configs}
        for _ in range(5):
            for hint, config in configs.items():
                times[hint].append(queued_ms(lambda: run_layer(*args, with_varlen_states=varlen, config=config)))
        ms = {hint: statistics.median(t) for hint, t in times.items()}
        print(f"{case.name}: {base}\n  hint 1 {ms[1]:.4f} ms, none {ms[0]:.4f} ms: none is x{ms[0] / ms[1]:.3f}; "
              f"{'same bits' if same else 'outputs differ'}", flush=True)


def _tensors(result):
    return [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]


if __name__ == "__main__":
    main()
