"""Scratch (GPU): why experiment 49's threads compiled other cubins than the launches look up.
Records a backward call's launches (nothing runs) and derives each one's signature with
KernelSignature.from_kernel_args, then runs the call on an empty disk cache with the kernel class's
_compile wrapped to keep the signature the JIT passes, and prints where the two differ.

    python3 benchmarks/variants/signature_diff.py
"""
import difflib
import tempfile

import torch
from cuda.tile._cext import default_tile_context
from cuda.tile._execution import kernel as kernel_class
from cuda.tile.compilation import CallingConvention, KernelSignature

import tilegym_mamba2
from tilegym_mamba2.cutile.launch import recording_launches
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs

default_tile_context.config.cache_dir = tempfile.mkdtemp()
spec = Mamba2ProblemSpec.from_shape((1, 700, 1, 6, 64, 32), chunk_size=128, device="cuda")
inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
dout, dfinal = torch.randn_like(inputs["x"]), torch.randn_like(inputs["init_state"])


def call():
    return tilegym_mamba2.mamba2_chunk_backward(**inputs, dout=dout, dfinal_state=dfinal)


with recording_launches() as launches:
    call()
derived = [(k._pyfunc.__name__, KernelSignature.from_kernel_args(k, a, CallingConvention.cutile_python_v1()))
           for k, a in launches]
jit = []
inner = kernel_class._compile


def keep(self, signature, context, compute_capability=None):
    jit.append((self._pyfunc.__name__, signature, context is default_tile_context, compute_capability))
    return inner(self, signature, context, compute_capability)


kernel_class._compile = keep
call()
torch.cuda.synchronize()
print(f"{len(launches)} launches recorded, {len(jit)} JIT compiles")
for name, signature, default_context, capability in jit:
    matches = [d for n, d in derived if n == name]
    same = any(d == signature for d in matches) or any(repr(d) == repr(signature) for d in matches)
    print(f"== {name}: default context {default_context}, capability {capability}, derived equal: {same}")
    if not same and matches:
        a, b = repr(matches[0]).replace(", ", ",\n").splitlines(), repr(signature).replace(", ", ",\n").splitlines()
        for line in list(difflib.unified_diff(a, b, "from_kernel_args", "jit", lineterm="", n=1))[:40]:
            print("   ", line[:200])
