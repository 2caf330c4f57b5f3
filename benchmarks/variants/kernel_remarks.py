"""CPU (no GPU): tileiras' optimisation remarks for the backward's kernels, compiled for sm_90 with
the signatures a JIT launch derives on the H200 (experiment 52).

The JIT derives each array's constraints in the `cutile_python_v2` calling convention: size-1
dimensions are shape constants, shapes divisible by 16 say so, strides that are multiples of 16
bytes say so (in elements), the base address divides by 16 bytes (run47, `signature_diff.py`;
rules checked against the mangled symbols: run46's profile names the 2.7B layer's chunk_grads
`chunk_grads_kernel_Kt2_A4bf16_7v8l0_8t1_ei16_p16_A4bf16_4...`, and so does this script). `aot.kernel_signature` assumes none of that, so its cubins are not the device's. Here
the signatures follow the JIT's rules, each kernel compiles through its own `_compile` (its own
options, e.g. occupancy) into an empty disk cache, and the remarks tileiras leaves in the cache's
metadata are summarised per kernel: which mma became SM90 (wgmma) or SM80 (mma.sync)
tensor-core code, which loads and stores became TMA. From each cubin's ELF: registers per thread,
the stack frame (spills) and the shared memory per block, which bound how many blocks share an SM
(an H200 SM has 228 KB of shared memory and 64K registers).

    python benchmarks/variants/kernel_remarks.py [B,T,G,H,N,P] [--aot]

--aot: aot.kernel_signature's assumptions instead, for comparison.
"""
import collections
import inspect
import json
import os
import re
import sqlite3
import struct
import sys
import tempfile

import cuda.tile as ct
import torch
from cuda.tile._cext import default_tile_context
from cuda.tile.compilation import ArrayConstraint, CallingConvention, KernelSignature, ScalarConstraint

from tilegym_mamba2.backward import chunk_backward
from tilegym_mamba2.cutile.aot import _DTYPES, kernel_signature
from tilegym_mamba2.cutile.launch import recording_launches
from tilegym_mamba2.cutile.scan import KERNELS


def jit_like_signature(kernel, args) -> KernelSignature:
    params = inspect.signature(kernel._pyfunc).parameters.values()
    constraints = []
    for param, arg in zip(params, args):
        if isinstance(arg, torch.Tensor):
            constraints.append(ArrayConstraint(
                _DTYPES[arg.dtype], arg.ndim, index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                may_alias_internally=False,
                stride_constant=tuple(1 if s == 1 else None for s in arg.stride()),
                shape_constant=tuple(1 if n == 1 else None for n in arg.shape),
                stride_divisible_by=tuple(16 // arg.element_size() if s != 1 and s * arg.element_size() % 16 == 0
                                          else 1 for s in arg.stride()),
                shape_divisible_by=tuple(16 if n % 16 == 0 else 1 for n in arg.shape),
                base_addr_divisible_by=16))
        elif param.annotation is inspect.Parameter.empty and isinstance(arg, int) and not isinstance(arg, bool):
            constraints.append(ScalarConstraint(ct.int32))
        else:
            constraints.append(arg)
    return KernelSignature(constraints, CallingConvention.cutile_python_v2()).with_mangled_symbol(
        kernel._pyfunc.__name__)


def summary(remarks: str):
    counts = collections.Counter()
    for doc in remarks.split("--- !")[1:]:
        name = re.search(r"Name:\s+(\S+)", doc).group(1)
        what = re.search(r"Instruction:\s+(.*)", doc) or re.search(r"Reason:\s+'?(.*?)'?$", doc, re.M)
        counts[(name, what.group(1)[-70:] if what else "")] += 1
    return counts


def resources(cubin: bytes) -> dict:
    """Registers and stack frame per thread (.nv.info's REGCOUNT 0x2f and FRAME_SIZE 0x11, each
    a (symbol, value) pair) and shared memory per block (.nv.shared.<kernel>'s size)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = headers[names_index][4]
    found = {}
    for header in headers:
        name = cubin[names + header[0]:cubin.index(b"\0", names + header[0])].decode()
        offset, size = header[4], header[5]
        if name.startswith(".nv.shared.") and "reserved" not in name:
            found["shared bytes"] = size
        if name == ".nv.info":
            i = offset
            while i + 4 <= offset + size:
                kind, attribute, length = cubin[i], cubin[i + 1], struct.unpack_from("<H", cubin, i + 2)[0]
                if kind == 0x04:  # a value of `length` bytes follows
                    if attribute in (0x2f, 0x11) and length >= 8:
                        found["registers" if attribute == 0x2f else "frame bytes"] = struct.unpack_from(
                            "<I", cubin, i + 8)[0]
                    i += 4 + length
                else:
                    i += 4
    return found


def backward_launches(shape):
    """The (kernel, args) of one mamba2_chunk_backward call of ``shape``, recorded on CPU tensors."""
    batch, tokens, groups, heads, state, head = shape
    x, dout = (torch.zeros(batch, tokens, heads, head, dtype=torch.bfloat16) for _ in range(2))
    b, c = (torch.zeros(batch, tokens, groups, state, dtype=torch.bfloat16) for _ in range(2))
    dt = torch.zeros(batch, tokens, heads)
    a, d = torch.zeros(heads), torch.zeros(heads)
    init, dfinal = torch.zeros(batch, heads, head, state), torch.zeros(batch, heads, head, state)
    with recording_launches() as launches:
        chunk_backward(KERNELS, x, a, b, c, d, dt, init, dout, dfinal)
    return launches


def compile_and_report(launches, aot=False, cache=None):
    """Compiles each distinct (kernel, signature) into an empty disk cache and prints what tileiras
    made of it."""
    cache = cache or tempfile.mkdtemp()
    default_tile_context.config.cache_dir = cache
    seen = set()
    for kernel, args in launches:
        signature = kernel_signature(kernel, args) if aot else jit_like_signature(kernel, args)
        if repr(signature) not in seen:
            seen.add(repr(signature))
            kernel._compile(signature, default_tile_context, (9, 0))
    db = sqlite3.connect(os.path.join(cache, "cache.db"))
    for cubin, meta in db.execute("select blob, metadata from cache"):
        meta = json.loads(meta)
        print(f"== {meta['kernel_names'][0][:64]}... tileiras {meta['compilation_time_seconds']:.1f} s, "
              f"{resources(bytes(cubin))}")
        for (name, what), n in sorted(summary(meta.get("remarks") or "").items()):
            print(f"   {n:2d} x {name}: {what}")


if __name__ == "__main__":
    shape = tuple(int(v) for v in (sys.argv[1] if len(sys.argv) > 1 and "," in sys.argv[1]
                                    else "2,8192,1,80,128,64").split(","))
    compile_and_report(backward_launches(shape), aot="--aot" in sys.argv)
