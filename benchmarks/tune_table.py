"""Measures the segment-length choices that ship with the package (GPU):
tilegym_mamba2/cutile/shipped_configs.json, looked up when a user's own tuning cache lacks a
bucket, so that a first call on common dimensions tunes nothing.

    python benchmarks/tune_table.py [--workers 6]

For each model shape in DIMS (heads, groups, head size, state size: Mamba-2 130M-2.7B, the
8B-class hybrids, head 128 and states 64 / 256) at each of ROWS, the plain op and the layer
op (D, z, dt_bias, softplus: what a model's mixer passes) each tune their bucket as a user's first
call would, with an empty cache and no shipped choices. First the kernels are compiled in
--workers processes side by side (nothing is timed then); the timing runs in this process alone.
The measured entries replace this GPU's entries in the shipped file; other GPUs' stay.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

# (heads, groups, head_size, state_size)
DIMS = [(24, 1, 64, 128), (48, 1, 64, 128), (64, 1, 64, 128), (80, 1, 64, 128), (128, 1, 64, 128),
        (128, 8, 64, 128), (64, 1, 64, 64), (64, 2, 64, 64), (32, 1, 128, 128), (64, 8, 128, 64),
        (64, 1, 64, 256), (32, 4, 128, 256)]
# (batch, tokens): a prefill, short and long training rows, and batched serving
ROWS = [(1, 1024), (1, 4096), (1, 16384), (1, 65536), (4, 4096), (4, 16384), (16, 2048), (16, 16384)]
CHUNK = 256


def inputs(batch, tokens, heads, groups, head_size, state_size):
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)
    x = randn(batch, tokens, heads, head_size)
    dt = torch.rand(batch, tokens, heads, generator=g, device="cuda") * 0.1
    a = -torch.rand(heads, generator=g, device="cuda") - 0.5
    b, c = randn(batch, tokens, groups, state_size, scale=0.3), randn(batch, tokens, groups, state_size, scale=0.3)
    d = torch.randn(heads, generator=g, device="cuda")
    return x, dt, a, b, c, d, randn(batch, tokens, heads, head_size), torch.zeros(heads, device="cuda")


def run_both(shape):
    import tilegym_mamba2
    x, dt, a, b, c, d, z, dt_bias = inputs(*shape)
    tilegym_mamba2.mamba2_chunk_forward(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=None, chunk_size=CHUNK)
    tilegym_mamba2.mamba_chunk_scan_combined(x, dt, a, b, c, CHUNK, D=d, z=z, dt_bias=dt_bias, dt_softplus=True,
                                             backend="cutile")
    torch.cuda.synchronize()


def shapes(dims):
    return [(batch, tokens, *dim) for dim in dims for batch, tokens in ROWS]


def warm(indexes):
    """Compiles every kernel the shapes of DIMS[indexes] run, tuning off (nothing timed)."""
    os.environ["TILEGYM_MAMBA2_TUNE"] = "0"
    for batch, tokens, heads, groups, head_size, state_size in shapes([DIMS[i] for i in indexes]):
        run_both((batch, tokens, heads, groups, head_size, state_size))


def main(workers):
    from tilegym_mamba2.runtime import tuning
    start = time.perf_counter()
    groups_of_dims = [list(range(len(DIMS)))[w::workers] for w in range(workers)]
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", ",".join(map(str, ids))]) for ids in groups_of_dims]
    if any(p.wait() for p in procs):
        sys.exit("a compiling worker failed")
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)

    os.environ["TILEGYM_MAMBA2_TUNE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "configs.json")
        fresh = tuning.ConfigCache(path, shipped=False)
        tuning._default_cache = lambda: fresh  # measure every bucket, ignoring what ships today
        for shape in shapes(DIMS):
            run_both(shape)
        with open(path) as f:
            measured = json.load(f)
    gpu = torch.cuda.get_device_name()
    try:
        with open(tuning.SHIPPED_CONFIGS) as f:
            table = {k: v for k, v in json.load(f).items() if not k.startswith(gpu + "|")}
    except FileNotFoundError:
        table = {}
    table.update(measured)
    with open(tuning.SHIPPED_CONFIGS, "w") as f:  # one bucket per line
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
                                     for k, v in sorted(table.items())) + "\n}\n")
    print(f"{len(measured)} entries for {gpu} written to {tuning.SHIPPED_CONFIGS} "
          f"in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    if "--warm" in sys.argv:
        warm([int(v) for v in sys.argv[sys.argv.index("--warm") + 1].split(",")])
    else:
        main(int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 6)
