"""CPU (no GPU): experiment 75's one-launch kernel (prefill.py) next to compute_out on a whole row,
compiled for sm_90 with the JIT's signatures (kernel_remarks.py): registers, stack (spills),
shared memory and tileiras' remarks, on the 2048-token prefill (1, 2048, 1, 32, 128, 64), bf16.

    python benchmarks/variants/prefill_resources.py   (with variants/experiment75_one_launch_prefill.patch applied)
"""
from dataclasses import replace

import torch

from kernel_remarks import compile_and_report  # this folder's
from tilegym_mamba2.cutile import choose_config, run_stages
from tilegym_mamba2.cutile.launch import recording_launches

BATCH, TOKENS, GROUPS, HEADS, STATE, HEAD = 1, 2048, 1, 32, 128, 64


def launches(config):
    x = torch.zeros(BATCH, TOKENS, HEADS, HEAD, dtype=torch.bfloat16)
    b, c = (torch.zeros(BATCH, TOKENS, GROUPS, STATE, dtype=torch.bfloat16) for _ in range(2))
    dt, a, d = torch.zeros(BATCH, TOKENS, HEADS, dtype=torch.bfloat16), torch.zeros(HEADS), torch.zeros(HEADS)
    init = torch.zeros(BATCH, HEADS, HEAD, STATE)
    with recording_launches() as recorded:
        run_stages(x, a, b, c, d, dt, init, 128, config)
    return recorded


if __name__ == "__main__":
    base = choose_config(BATCH, TOKENS, GROUPS, HEADS, HEAD, STATE, 128)
    whole = replace(base, chunks_per_segment=TOKENS // base.chunk_size)
    compile_and_report([(k, args) for k, args in launches(whole) if k._pyfunc.__name__.startswith("compute_out")])
    compile_and_report(launches(replace(base, one_launch=True)))
