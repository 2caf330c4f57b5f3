"""Scratch (GPU): the whole plain op at the tuned config of each shape (the control) and at
variants of it, each variant a few Config fields or kernel hints changed (a kernel hint,
e.g. compute_out_kernel.occupancy=1, swaps in kernel.replace_hints(...) while the variant
runs; a chunk_size alone keeps the segments' token length). All run in alternating rounds
(CUDA-event medians of 30 after warm-up each) so that clock drift lands on every one; the
median over rounds is reported, with whether the output equals the control's to the bit.

    cd benchmarks/variants && python3 config_op.py [field=value[,kernel.hint=value] ...]

Without arguments: the load-latency hints (NOTES.md, experiment 24).
"""
import contextlib
import importlib
import statistics
import sys
from dataclasses import replace

import torch

from tilegym_mamba2.cutile import config_for, run_stages
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.validation import check_forward_args
from timing import median_ms

SHAPES = [(4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64), (4, 65536, 1, 8, 128, 64),
          (1, 2048, 1, 32, 128, 64), (8, 4096, 1, 32, 64, 128), (2, 8192, 8, 64, 256, 64)]
DEFAULT_VARIANTS = ["out_load_latency=0", "out_load_latency=2"]


# The package's __init__ re-exports the stage functions under the modules' names.
output_stage = importlib.import_module("tilegym_mamba2.cutile.compute_out")
state_pass = importlib.import_module("tilegym_mamba2.cutile.fwd_pass_state")
KERNEL_MODULES = {"segment_states_kernel": state_pass, "wide_segment_states_kernel": state_pass}


def parse(variant: str) -> tuple[dict, dict]:
    """'a=1,k.h=2' -> ({a: 1}, {k: {h: 2}})"""
    fields, hints = {}, {}
    for item in variant.split(","):
        name, value = item.split("=")
        if "." in name:
            kernel, hint = name.split(".")
            hints.setdefault(kernel, {})[hint] = int(value)
        else:
            fields[name] = int(value)
    return fields, hints


@contextlib.contextmanager
def hinted(hints: dict):
    """compute_out_kernel hints apply to every entry of compute_out.KERNELS."""
    hints = dict(hints)
    out_hints = hints.pop("compute_out_kernel", None)
    originals = {kernel: getattr(KERNEL_MODULES[kernel], kernel) for kernel in hints}
    out_kernels = output_stage.KERNELS
    try:
        for kernel, kernel_hints in hints.items():
            setattr(KERNEL_MODULES[kernel], kernel, originals[kernel].replace_hints(**kernel_hints))
        if out_hints:
            output_stage.KERNELS = {k: v.replace_hints(**out_hints) for k, v in out_kernels.items()}
        yield
    finally:
        for kernel, original in originals.items():
            setattr(KERNEL_MODULES[kernel], kernel, original)
        output_stage.KERNELS = out_kernels


variants = sys.argv[1:] or DEFAULT_VARIANTS
for shape in SHAPES:
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    args = check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False)),
                              backend="cutile")
    tuned = config_for(*args)
    configs = {"control": (tuned, {})}
    for v in variants:
        fields, hints = parse(v)
        if "chunk_size" in fields and "chunks_per_segment" not in fields:  # keep the segments' token length
            fields["chunks_per_segment"] = max(1, tuned.chunks_per_segment * tuned.chunk_size // fields["chunk_size"])
        configs[v] = (replace(tuned, **fields), hints)
    control = run_stages(*args, config=tuned)
    same, rounds = {}, {name: [] for name in configs}
    for name, (config, hints) in configs.items():
        try:
            with hinted(hints):
                stages = run_stages(*args, config=config)
            if torch.equal(stages.out, control.out) and torch.equal(stages.final_state, control.final_state):
                same[name] = "same bits"
            else:  # e.g. another chunk length: the same math, other rounding
                diff = ((stages.out.float() - control.out.float()).norm() / control.out.float().norm()).item()
                same[name] = f"out differs by {diff:.1e}"
        except Exception as e:  # a variant that does not compile is a result too
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            del rounds[name]
    for _ in range(5):
        for name in rounds:
            config, hints = configs[name]
            with hinted(hints):
                rounds[name].append(median_ms(lambda: run_stages(*args, config=config), reps=30))
    base = statistics.median(rounds["control"])
    print(f"{shape}  tuned {tuned}", flush=True)
    for name, times in rounds.items():
        ms = statistics.median(times)
        print(f"  {name:42s} {ms:.4f} ms  x{ms / base:.3f}  {same[name]}  "
              f"rounds {' '.join(f'{t:.3f}' for t in times)}", flush=True)
