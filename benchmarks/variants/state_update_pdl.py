"""Experiment 76 (GPU; compiles on a CPU with --resources): the decode step with programmatic
dependent launch, against the package and mamba_ssm's kernel.

After experiment 71 the step is 0.88x / 0.93x mamba_ssm's at batch 1 / 8 in CUDA-graph replay
(3.81 / 16.70 against 3.36 / 15.60 us, run78), a few microseconds in which a launch's own latency
is a large part. With programmatic dependent launch (`ct.launch(...,
programmatic_dependent_launch=True)`) a kernel's blocks may be scheduled before the kernel ahead
of it in the stream has finished; each block then waits (`ct.grid_dependency_control_wait()`,
before its first load: every input may come from that kernel) until the predecessor is done and
its writes are visible, so the results cannot change. Variants, the package's text edited, through
the package's host code at its tiles, each checked to the bit:
  wait            the wait first in the kernel, the launch flag set
  wait+trigger    and `ct.grid_dependency_control_launch_dependents()` right after it, so that
                  the next step's blocks are scheduled once every block of this one has started
A graph of consecutive steps (as `bench --serving` replays) is where it shows; in a model the
kernel ahead is the convolution update or a GEMM.

    python3 benchmarks/variants/state_update_pdl.py [batch ...]
    python benchmarks/variants/state_update_pdl.py --resources   (CPU: compiles for sm_90)
"""
import pathlib
import sys

import cuda.tile as ct
import torch

from edited import module_from  # this folder's
from tilegym_mamba2 import bench_serving
from tilegym_mamba2.cutile import launch as launches
from tilegym_mamba2.cutile import plan
from tilegym_mamba2.cutile import selective_state_update as ssu

CALLS = 8
PACKAGE = pathlib.Path(ssu.__file__)
TOP = "    row, head, p_tile = ct.bid(0), ct.bid(1), ct.bid(2)\n"
EDITS = {
    "wait": [(TOP, TOP + "    ct.grid_dependency_control_wait()\n")],
    "wait+trigger": [(TOP, TOP + "    ct.grid_dependency_control_wait()\n"
                           "    ct.grid_dependency_control_launch_dependents()\n")],
}
PACKAGE_KERNEL, PACKAGE_LAUNCH = ssu.selective_state_update_kernel, ssu.launch


def pdl_launch(grid, kernel, args):
    if launches._recording is not None:
        launches._recording.append((kernel, tuple(args)))
        return
    ct.launch(launches.current_stream(args[0].get_device()), grid, kernel, tuple(args),
              programmatic_dependent_launch=True)


def use(kernel=None):
    """Routes the package's host code to ``kernel`` launched with the flag (None: the package)."""
    plan.forget()
    ssu.selective_state_update_kernel = kernel or PACKAGE_KERNEL
    ssu.launch = PACKAGE_LAUNCH if kernel is None else pdl_launch


def main(batches):
    from timing import graph_us, print_rows, variant_row  # this folder's
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as peer
    except Exception as e:  # noqa: BLE001
        peer = None
        print(f"mamba_ssm not importable: {type(e).__name__}")
    kernels = {name: module_from(PACKAGE, edits, stem=f"state_update_{name.replace('+', '_')}")
               .selective_state_update_kernel for name, edits in EDITS.items()}
    for batch in batches:
        case = bench_serving.ServingCase("selective_state_update", batch)
        argsets = [bench_serving.state_update_inputs(case, seed=i) for i in range(CALLS)]
        ref = argsets[0]["state"].clone()
        use()
        want = ssu.selective_state_update(**dict(argsets[0], state=ref.clone()))
        rows = [("package", graph_us([lambda a=a: ssu.selective_state_update(**a) for a in argsets]))]
        if peer is not None:
            rows.append(("mamba_ssm", graph_us([lambda a=a: peer(**a) for a in argsets])))
        for name, kernel in kernels.items():
            use(kernel)
            rows.append(variant_row(
                f"PDL, {name}",
                lambda: torch.equal(ssu.selective_state_update(**dict(argsets[0], state=ref.clone())), want),
                [lambda a=a: ssu.selective_state_update(**a) for a in argsets]))
        use()
        print_rows(f"batch {batch}", rows, bench_serving.floor_bytes(case) / 1e6)


def resources():
    """Compiles each variant for sm_90 on CPU placeholders of batch 8 (no GPU)."""
    from kernel_remarks import compile_and_report  # this folder's
    kwargs = bench_serving.state_update_inputs(bench_serving.ServingCase("selective_state_update", 8), device="cpu")
    args = ssu.state_update_args(**{k: kwargs.get(k) for k in ("state", "x", "dt", "A", "B", "C", "D", "z",
                                                                "dt_bias", "dt_softplus", "state_batch_indices")})
    for name, edits in EDITS.items():
        use(module_from(PACKAGE, edits, stem=f"state_update_{name.replace('+', '_')}").selective_state_update_kernel)
        with launches.recording_launches() as recorded:
            ssu.run_state_update(args, ssu.launch_plan(args))
        print(f"### PDL, {name}", flush=True)
        compile_and_report(recorded)
    use()


if __name__ == "__main__":
    if "--resources" in sys.argv:
        resources()
    else:
        main([int(b) for b in sys.argv[1:]] or [1, 8, 64, 256])
