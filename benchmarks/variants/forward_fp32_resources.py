"""CPU (no GPU): the forward's kernels for fp32 inputs on the source config, compiled for sm_90
with the JIT's signatures (kernel_remarks.py), at a PyTorch float32 matmul precision: registers,
stack (spills), shared memory and tileiras' remarks per kernel (experiment 70). With
--configs, compute_out and segment_states at config variants as well (out_head_tile,
occupancy, the state pass's tiles).

    python benchmarks/variants/forward_fp32_resources.py [highest|high] [--configs]
"""
import dataclasses
import sys

import torch

from kernel_remarks import compile_and_report  # this folder's
from tilegym_mamba2.cutile import choose_config, run_stages
from tilegym_mamba2.cutile.launch import recording_launches

SHAPE = (4, 16384, 1, 8, 128, 64)  # batch, tokens, groups, heads, state, head
VARIANTS = [dict(out_head_tile=32), dict(out_head_tile=16), dict(out_occupancy=1),
            dict(out_head_tile=32, out_occupancy=1), dict(state_head_tile=32),
            dict(state_head_tile=32, state_tile=32)]


def launches(config):
    batch, tokens, groups, heads, state, head = SHAPE
    x = torch.zeros(batch, tokens, heads, head)
    b, c = (torch.zeros(batch, tokens, groups, state) for _ in range(2))
    dt, a, d = torch.zeros(batch, tokens, heads), torch.zeros(heads), torch.zeros(heads)
    with recording_launches() as recorded:
        run_stages(x, a, b, c, d, dt, None, 256, config)
    return recorded


if __name__ == "__main__":
    torch.set_float32_matmul_precision(next((a for a in sys.argv[1:] if not a.startswith("-")), "highest"))
    batch, tokens, groups, heads, state, head = SHAPE
    base = choose_config(batch, tokens, groups, heads, head, state, 256)
    print("###", base, flush=True)
    compile_and_report(launches(base))
    for fields in VARIANTS if "--configs" in sys.argv else ():
        wanted = "compute_out" if any(k.startswith("out_") for k in fields) else "segment_states"
        print("###", fields, flush=True)
        compile_and_report([(k, args) for k, args in launches(dataclasses.replace(base, **fields))
                            if k._pyfunc.__name__.startswith(wanted)])
