"""A call's kernels compiled side by side before its first run (issue 13: a new shape's first
backward under 10 s, compile included; benchmarks/NOTES.md, experiment 49).

A launch compiles its kernel when cuTile has none for the signature its arguments give (dtypes,
ranks, constants, and which shapes, strides and addresses divide by 16, so a new shape usually
means new signatures). Left alone, the kernels of a call compile one after another as the host
code reaches them, each mostly a tileiras subprocess (chunk_grads ~8 s on the H200's host).

Here the call's launches are first recorded (nothing runs), and each distinct kernel is compiled
in a thread of its own for the signature those very arguments give, with the kernel's own
options, through the kernel's own compile: the cubins land in cuTile's disk cache under the keys
the call's launches then look up. cuTile holds one lock over a whole compile, tileiras included;
our threads let it go while their tileiras runs (a separate process that touches none of
cuTile's state), so the front ends take turns and the tileiras runs overlap.

Everything here is an optimisation: without a disk cache, on a cuTile without these internals, or
when a compile fails (the call's own launch then compiles and reports it), the call simply
compiles as it goes.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .launch import recording, recording_launches
from .tuning import capturing

_one_at_a_time = threading.Lock()  # the tileiras wrapper below is installed by one caller at a time
_seen = set()  # keys of the calls compiled ahead


def compiled_ahead(key, run):
    """run(); the first time ``key`` (plan.signature of the call) is seen, its kernels are first
    compiled side by side. A key of None (arguments a signature cannot hold) compiles as it goes.
    The forward ops do the same for their first call of a shape in cutile.config_for."""
    if key is not None and key not in _seen and not capturing() and not recording():
        with recording_launches() as launches:
            run()
        compile_side_by_side(launches)
        _seen.add(key)
    return run()


def compile_side_by_side(launches) -> int:
    """Compiles each distinct (kernel, signature) of ``launches`` [(kernel, args)] in its own
    thread into cuTile's disk cache. -> how many were compiled (0: nothing to gain or no way)."""
    try:
        import cuda.tile._compile as tile_compile
        from cuda.tile._cext import default_tile_context
        from cuda.tile.compilation import CallingConvention, KernelSignature
        tileiras, lock = tile_compile.compile_cubin, tile_compile._compiler_lock
        lock._release_save, lock._acquire_restore  # noqa: B018 (the RLock internals used below)
    except (ImportError, AttributeError):
        return 0
    tensors = [a for _, args in launches for a in args if isinstance(a, torch.Tensor)]
    if default_tile_context.config.cache_dir is None or not tensors or not tensors[0].is_cuda or recording():
        return 0  # no disk cache to meet in, a CPU run, or an outer recording (nothing will launch)
    jobs = {}
    for kernel, args in launches:
        signature = KernelSignature.from_kernel_args(kernel, args, CallingConvention.cutile_python_v1())
        jobs.setdefault((id(kernel), repr(signature)), (kernel, signature))
    if len(jobs) < 2:
        return 0
    capability = torch.cuda.get_device_capability(tensors[0].device)

    def tileiras_unlocked(*args, **kwargs):
        state = lock._release_save() if lock._is_owned() else None
        try:
            return tileiras(*args, **kwargs)
        finally:
            if state is not None:
                lock._acquire_restore(state)

    def compile_one(job):
        kernel, signature = job
        try:
            kernel._compile(signature, default_tile_context, capability)
        except Exception:  # noqa: BLE001 (the call's own launch compiles it again and reports it)
            pass

    with _one_at_a_time:
        tile_compile.compile_cubin = tileiras_unlocked
        try:
            with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1)) as pool:
                list(pool.map(compile_one, jobs.values()))
        finally:
            tile_compile.compile_cubin = tileiras
    return len(jobs)
