"""CPU (no GPU): the instructions of every chunk-state walk the backward launches without z
(bf16 / fp16 / fp32, with and without packed sequences and an initial state, 8 and 80 heads,
forward and reverse, plain and crowded), compiled for sm_90 with the JIT's signatures, to show
that a change meant to leave those walks as they were does (experiment 72: the gated dy's low
half in the reverse walk, for the layer op with z only). A new array argument moves the
parameters after it, so the code hashes of machine_code.py differ; what must not change is the
instruction stream but for those parameters' addresses.

    python benchmarks/variants/machine_code_walk.py --dump before.pkl   (at each revision)
    python benchmarks/variants/machine_code_walk.py --compare before.pkl after.pkl
    python benchmarks/variants/machine_code_walk.py --low   (the walk with the low half: resources)

--compare prints per launch the instruction count and each differing 16-byte instruction's
differing bytes.
"""
import itertools
import pickle
import sys

import torch

from kernel_remarks import compile_and_report  # this folder's
from machine_code import distinct_cubins, sections  # this folder's
from tilegym_mamba2.backward import scan_backward
from tilegym_mamba2.cutile.chunk_states_walk import chunk_states_walk
from tilegym_mamba2.cutile.launch import recording_launches
from tilegym_mamba2.cutile.scan import KERNELS


def walk_launches(dtype, has_seq, with_init, heads):
    batch, tokens, head_size, state_size = 2, 1000, 64, 128
    x, dout = (torch.zeros(batch, tokens, heads, head_size, dtype=dtype) for _ in range(2))
    b, c = (torch.zeros(batch, tokens, 1, state_size, dtype=dtype) for _ in range(2))
    dt, a, d = torch.zeros(batch, tokens, heads), torch.zeros(heads), torch.zeros(heads)
    init = torch.zeros(batch, heads, head_size, state_size) if with_init else None
    dfinal = torch.zeros(batch, heads, head_size, state_size)
    seq_idx = torch.zeros(batch, tokens, dtype=torch.int32) if has_seq else None
    with recording_launches() as recorded:
        scan_backward(KERNELS, x, a, b, c, dt, dout, d[:, None], initial_states=init, seq_idx=seq_idx,
                      dfinal_states=dfinal)
    return [(k, args) for k, args in recorded if k._pyfunc.__name__ == "chunk_states_walk_kernel"]


def text_section(cubin: bytes) -> bytes:
    return next(data for name, _, data in sections(cubin) if name.startswith(".text"))


def dump(path):
    """{label: .text bytes} of every distinct walk launch, in launch order."""
    launches = ((f"{str(dtype)[6:]} seq={has_seq} init={with_init} heads={heads} walk {i}", kernel, args)
                for dtype, has_seq, with_init, heads in itertools.product(
                    (torch.bfloat16, torch.float16, torch.float32), (False, True), (False, True), (8, 80))
                for i, (kernel, args) in enumerate(walk_launches(dtype, has_seq, with_init, heads)))
    found = {label: text_section(cubin) for label, _, cubin in distinct_cubins(launches)}
    with open(path, "wb") as f:
        pickle.dump(found, f)


def compare(before_path, after_path):
    with open(before_path, "rb") as f:
        before = pickle.load(f)
    with open(after_path, "rb") as f:
        after = pickle.load(f)
    assert before.keys() == after.keys(), "different launches"
    for label, old in before.items():
        new = after[label]
        differing = [(i, [j for j in range(16) if old[16 * i + j] != new[16 * i + j]])
                     for i in range(min(len(old), len(new)) // 16) if old[16 * i:16 * i + 16] != new[16 * i:16 * i + 16]]
        changed_bytes = sorted({j for _, js in differing for j in js})
        print(f"{label:38s} instructions {len(old) // 16:5d} -> {len(new) // 16:5d}, differing {len(differing):3d} "
              f"(bytes {changed_bytes})")


def low_resources():
    dy, dy_low = (torch.zeros(2, 1000, 80, 64, dtype=torch.bfloat16) for _ in range(2))
    c = torch.zeros(2, 1000, 1, 128, dtype=torch.bfloat16)
    decay = torch.zeros(2, 80, 1024)
    for seq in (None, torch.zeros(2, 1000, dtype=torch.int32)):
        with recording_launches() as recorded:
            chunk_states_walk(dy, c, decay, decay, torch.zeros(2, 80, 64, 128), 64, reverse=True, seq_idx=seq,
                              x_low=dy_low)
        print(f"### the reverse walk with the low half, seq_idx {seq is not None}", flush=True)
        compile_and_report(recorded)


if __name__ == "__main__":
    if sys.argv[1] == "--dump":
        dump(sys.argv[2])
    elif sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        low_resources()
