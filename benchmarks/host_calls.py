"""Python calls per op: how much host code one call runs between the user's line and its kernels.

    python benchmarks/host_calls.py [LABEL]

Counts the Python function calls (sys.setprofile's "call" events; C functions not counted) of one
call, made after two warm-up calls of the same shape (so call plans, tuned configs and compiled
kernels are in place), split into this package's, tilegym's and the rest (torch, the standard
library), with the number of this package's files they run in. Cases:

  plain_grad    tilegym.ops.mamba2_chunk_forward, inputs requiring grad (the forward only)
  layer_grad    tilegym_mamba2.mamba_chunk_scan_combined with D, z, dt_bias, softplus, requiring grad
  packed        the same without grad, 8 sequences packed by cu_seqlens
  packed_grad   the same requiring grad

On a CUDA machine the calls run on the cutile backend; without one on the pytorch backend (the
dispatch path is the same down to the backend's runner). Counts are deterministic: the numbers in
docs/design.md ("One dispatch path") come from this script, run on both checkouts in turn through
PYTHONPATH. LABEL (default "?") starts every line.
"""
import collections
import os
import sys

import torch

import tilegym
import tilegym_mamba2

PACKAGE = os.path.dirname(os.path.abspath(tilegym_mamba2.__file__))
TILEGYM = os.path.dirname(os.path.abspath(tilegym.__file__))


def counted(fn):
    """(calls per origin, this package's files) of one fn()."""
    calls, files = collections.Counter(), set()

    def profile(frame, event, arg):
        if event != "call":
            return
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(PACKAGE):
            calls["ours"] += 1
            files.add(os.path.relpath(path, PACKAGE))
        elif path.startswith(TILEGYM):
            calls["tilegym"] += 1
        else:
            calls["other"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls, files


def cases(device):
    gen = torch.Generator().manual_seed(0)
    batch, tokens, heads, groups, head_size, state = 1, 512, 8, 1, 64, 64
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def randn(*shape, grad=False, dt=dtype):
        return torch.randn(shape, generator=gen).to(device, dt).requires_grad_(grad)

    def plain(grad):
        x, b, c = randn(batch, tokens, heads, head_size, grad=grad), randn(batch, tokens, groups, state, grad=grad), \
            randn(batch, tokens, groups, state, grad=grad)
        a = (-torch.rand(heads, generator=gen) - 0.5).to(device).requires_grad_(grad)
        d = randn(heads, grad=grad, dt=torch.float32)
        dt = torch.nn.functional.softplus(randn(batch, tokens, heads) - 2).detach().requires_grad_(grad)
        extra = {} if device == "cuda" else {"backend": "pytorch"}
        return lambda: tilegym.ops.mamba2_chunk_forward(x, a, b, c, d, dt, None, 128, **extra)

    def layer(grad, packed):
        x, B, C = randn(batch, tokens, heads, head_size, grad=grad), randn(batch, tokens, groups, state, grad=grad), \
            randn(batch, tokens, groups, state, grad=grad)
        dt, z = randn(batch, tokens, heads, grad=grad), randn(batch, tokens, heads, head_size, grad=grad)
        A = (-torch.rand(heads, generator=gen) - 0.5).to(device).requires_grad_(grad)
        D, dt_bias = randn(heads, grad=grad, dt=torch.float32), randn(heads, grad=grad, dt=torch.float32)
        extra = {}
        if packed:
            extra["cu_seqlens"] = torch.linspace(0, tokens, 9).round().to(device, torch.int32)
        return lambda: tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, 128, D=D, z=z, dt_bias=dt_bias,
                                                                dt_softplus=True, **extra)

    return {"plain_grad": plain(True), "layer_grad": layer(True, False), "packed": layer(False, True),
            "packed_grad": layer(True, True)}


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "?"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"# {label}: {device}, torch {torch.__version__}; calls of one warm call")
    print("label case ours tilegym other ours_files")
    for name, call in cases(device).items():
        for _ in range(2):
            call()
        if device == "cuda":
            torch.cuda.synchronize()
        calls, files = counted(call)
        print(label, name, calls["ours"], calls["tilegym"], calls["other"], len(files))


if __name__ == "__main__":
    main()
