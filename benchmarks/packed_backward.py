"""The layer op's forward + backward through autograd with packed sequences (seq_idx) against one
sequence per row (GPU), on the source config and the 2.7B layer's shape.

    python benchmarks/packed_backward.py [--with-z]

Packed rows hold four sequences each, their edges inside chunks; both forms run
mamba_chunk_scan_combined with D, dt_bias and softplus, then torch.autograd.grad of every input.
--with-z: the mixer's z gate as well. For each shape and form it prints `bench`'s median (L2
flushed), the kernels' GPU time per call summed (torch.profiler) and the number of kernels per
call, then the profiler's table of the top kernels by GPU time.
"""
import sys

import torch

import tilegym_mamba2
from tilegym_mamba2.bench.forward import measure
from timing import gpu_busy  # benchmarks/timing.py

SHAPES = ((4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64))  # batch, tokens, groups, heads, state, head


def layer_inputs(batch, tokens, groups, heads, state, head, packed, with_z=False):
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    x = randn(batch, tokens, heads, head).bfloat16()
    dt = (randn(batch, tokens, heads) - 2).bfloat16()
    a = -torch.rand(heads, device="cuda", generator=g) * 8 - 1
    b, c = (randn(batch, tokens, groups, state).bfloat16() for _ in range(2))
    d, dt_bias = randn(heads), randn(heads) - 1
    z = (randn(batch, tokens, heads, head).bfloat16(),) if with_z else ()
    leaves = [t.requires_grad_() for t in (x, dt, a, b, c, d, dt_bias, *z)]
    seq_idx = None
    if packed:  # four sequences per row, their edges inside chunks
        cuts = torch.tensor([tokens // 7, tokens // 3 + 5, (3 * tokens) // 4 - 9], device="cuda")
        seq = (torch.arange(tokens, device="cuda")[:, None] >= cuts[None, :]).sum(1).to(torch.int32)
        seq_idx = seq.expand(batch, tokens).contiguous()
    return leaves, seq_idx, randn(batch, tokens, heads, head).bfloat16()


def step(leaves, seq_idx, dout):
    x, dt, a, b, c, d, dt_bias, *z = leaves
    out = tilegym_mamba2.mamba_chunk_scan_combined(x, dt, a, b, c, 256, D=d, z=z[0] if z else None, dt_bias=dt_bias,
                                                   dt_softplus=True, seq_idx=seq_idx)
    return torch.autograd.grad(out, leaves, dout)


def main(with_z):
    for shape in SHAPES:
        for packed in (False, True):
            leaves, seq_idx, dout = layer_inputs(*shape, packed, with_z=with_z)

            def fn():
                return step(leaves, seq_idx, dout)
            busy, kernels, prof = gpu_busy(fn)
            label = "packed (4 sequences per row)" if packed else "one sequence per row"
            print(f"{shape} {label:30s} bench {measure(fn):.3f} ms  GPU busy {busy:.3f} ms/call ({kernels} kernels)",
                  flush=True)
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main(with_z="--with-z" in sys.argv[1:])
