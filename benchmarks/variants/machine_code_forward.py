"""CPU (no GPU): machine_code.py for the forward's kernels. A hash of the code of every kernel the
plain op and the layer op launch, compiled for sm_90 with the JIT's signatures, at PyTorch's
current float32 matmul precision, to show that a change meant to leave the GPU-tested forward
as it was (experiment 70: tf32 operands for fp32 inputs only when that precision allows them)
does: the same hashes before and after at "highest" for every dtype, and for 16-bit inputs at
"high" too.

    python benchmarks/variants/machine_code_forward.py [highest|high] > after.txt   (and at the other revision)

Cases: the plain op at the model-like shape (head 64, state 128, chunk 128; bf16 and fp32, with
and without an initial state) and at small tiles (head 32, state 64, chunk 32) in bf16 / fp16 /
fp32; the layer op with every option at small tiles, initial states per row or per sequence, 4
heads or 16 (C·B^T from group_scores) per group, in the three dtypes.
"""
import itertools
import sys

import torch

from machine_code import code_hash, distinct_cubins  # this folder's
from tilegym_mamba2.cutile import choose_config, run_stages
from tilegym_mamba2.cutile.launch import recording_launches
from tilegym_mamba2.cutile.scan_combined import run_layer

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMALL = dict(tokens=300, head_size=32, state_size=64, chunk_size=32)


def plain_launches(dtype, with_init, batch=2, tokens=1000, heads=8, head_size=64, state_size=128, chunk_size=128):
    x = torch.zeros(batch, tokens, heads, head_size, dtype=dtype)
    b, c = (torch.zeros(batch, tokens, 1, state_size, dtype=dtype) for _ in range(2))
    dt = torch.zeros(batch, tokens, heads, dtype=dtype)
    a, d = torch.zeros(heads), torch.zeros(heads)
    init = torch.zeros(batch, heads, head_size, state_size) if with_init else None
    config = choose_config(batch, tokens, 1, heads, head_size, state_size, chunk_size)
    with recording_launches() as recorded:
        run_stages(x, a, b, c, d, dt, init, chunk_size, config)
    return recorded


def layer_launches(dtype, per_sequence_init, heads, tokens, head_size, state_size, chunk_size, sequences=3):
    x, z = (torch.zeros(1, tokens, heads, head_size, dtype=dtype) for _ in range(2))
    b, c = (torch.zeros(1, tokens, 1, state_size, dtype=dtype) for _ in range(2))
    dt = torch.zeros(1, tokens, heads, dtype=dtype)
    a, dt_bias, d = torch.zeros(heads), torch.zeros(heads), torch.zeros(heads, head_size)
    cu_seqlens = torch.linspace(0, tokens, sequences + 1).round().to(torch.int32)
    init = torch.zeros(sequences if per_sequence_init else 1, heads, head_size, state_size)
    config = choose_config(1, tokens, 1, heads, head_size, state_size, chunk_size)
    with recording_launches() as recorded:
        run_layer(x, dt, a, b, c, chunk_size, d, z, dt_bias, init, None, cu_seqlens, True, (0.001, 0.1),
                  with_varlen_states=True, config=config)
    return recorded


def cases():
    for dtype, with_init in itertools.product((torch.bfloat16, torch.float32), (True, False)):
        yield f"plain {str(dtype)[6:]} init={with_init}", plain_launches(dtype, with_init)
    for dtype in DTYPES:
        small = {k: SMALL[k] for k in ("head_size", "state_size", "chunk_size")}
        yield f"plain small {str(dtype)[6:]}", plain_launches(dtype, True, tokens=SMALL["tokens"], heads=4, **small)
        for per_sequence_init, heads in ((False, 4), (True, 4), (False, 16)):
            yield (f"layer small {str(dtype)[6:]} per_sequence_init={per_sequence_init} heads={heads}",
                   layer_launches(dtype, per_sequence_init, heads, **SMALL))


def main():
    """One line per distinct launch, in launch order: the case, the kernel, its code's hash."""
    torch.set_float32_matmul_precision(sys.argv[1] if len(sys.argv) > 1 else "highest")
    launches = ((label, kernel, args) for label, recorded in cases() for kernel, args in recorded)
    for label, kernel, cubin in distinct_cubins(launches):
        print(f"{label:55s} {kernel._pyfunc.__name__:24s} {code_hash(cubin)}", flush=True)


if __name__ == "__main__":
    main()
