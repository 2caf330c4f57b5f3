"""Experiment 79b (GPU): which stores of the chained kernel make its final state vary between runs.

run91: with the staged sums loaded through TMA (the variant's layout: 168 registers, 192 bytes of
stack, 0.046 ms of kernel against 0.076), three GPU tests saw the final state differ between
repeated calls of the same inputs while the outputs stayed equal to the bit. Suspect: a TMA store
whose shared-memory source is reused by a later TMA load before the store has read it (the kernel
now holds 223 KB of shared memory). Each variant below is the package's kernel with some stores
made ordinary (allow_tma=False), written next to the package module and imported from there:
  tma           the package as it is (the suspect)
  final         the final state's store ordinary
  final+sums    that and the staged sums' stores ordinary
  loads         the sums' loads ordinary (experiment 78's layout, known to repeat its bits)
Per variant: CALLS repeats of the prefill at 2 and 4 chunks per segment, with and without an
initial state, each compared to the first call to the bit (mismatching calls counted), the
relative difference to the "loads" variant, then the GPU time per call in graph replay.
With --apply, the fastest variant without a mismatch replaces the package module (on this
machine only; the chosen name is printed and written to $OUT/chosen.txt).
"""
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import graph_us  # noqa: E402 (this folder's)

import tilegym_mamba2.cutile as cutile_package  # noqa: E402
from tilegym_mamba2.cutile.tuning import chained_config, choose_config  # noqa: E402
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs  # noqa: E402
from tilegym_mamba2.validation import check_forward_args  # noqa: E402

PACKAGE = os.path.join(os.path.dirname(cutile_package.__file__), "chained_prefill.py")
CALLS = int(os.environ.get("CALLS", 100))
FINAL = "ct.store(final_state, (batch, head, p_tile, 0), leaving.reshape((1, 1, head_tile, state_size)))"
SUMS_STORES = ("ct.store(sums, (0, batch, head, chunk), dt_tile.reshape((1, 1, 1, chunk_size)))",
               "ct.store(sums, (1, batch, head, chunk), g.reshape((1, 1, 1, chunk_size)))")
SUMS_LOAD = "(1, 1, 1, chunk_size)).reshape((chunk_size,))"  # the two loads of the sums


def ordinary(call: str) -> str:
    return call[:-1] + ", allow_tma=False)"


def variant_sources(source: str) -> dict:
    def edit(text, old, new):
        assert text.count(old) == 1, old
        return text.replace(old, new)
    final = edit(source, FINAL, ordinary(FINAL))
    final_sums = final
    for store in SUMS_STORES:
        final_sums = edit(final_sums, store, ordinary(store))
    assert source.count(SUMS_LOAD) == 2
    loads = source.replace(SUMS_LOAD, "(1, 1, 1, chunk_size), allow_tma=False).reshape((chunk_size,))")
    return {"tma": source, "final": final, "final+sums": final_sums, "loads": loads}


def load_variant(name: str, source: str):
    module = "_race_" + name.replace("+", "_")
    with open(os.path.join(os.path.dirname(PACKAGE), module + ".py"), "w") as f:
        f.write(source)
    return importlib.import_module("tilegym_mamba2.cutile." + module)


def inputs(with_init: bool):
    spec = Mamba2ProblemSpec.from_shape((1, 2048, 1, 32, 128, 64), chunk_size=128, device="cuda")
    args = list(check_forward_args(**forward_inputs(spec.get_sample_inputs(with_reference=False,
                                                                            with_backward=False)),
                                   backend="cutile"))
    if not with_init:
        args[6] = None
    return args


def main():
    source = open(PACKAGE).read()
    modules = {name: load_variant(name, text) for name, text in variant_sources(source).items()}
    base = choose_config(1, 2048, 1, 32, 64, 128, 128)
    cases = {(per_segment, with_init): (inputs(with_init), chained_config(base, per_segment))
             for per_segment in (2, 4) for with_init in (True, False)}
    reference = {case: modules["loads"].chained_prefill(*args[:7], config) for case, (args, config) in cases.items()}
    rows = {}
    for name, module in modules.items():
        mismatches, worst = 0, 0.0
        for case, (args, config) in cases.items():
            first = module.chained_prefill(*args[:7], config)
            torch.cuda.synchronize()
            for _ in range(CALLS):
                again = module.chained_prefill(*args[:7], config)
                mismatches += not (torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]))
            for got, want in zip(first, reference[case]):
                worst = max(worst, ((got.double() - want.double()).norm() / want.double().norm()).item())
        args, config = cases[(4, True)]
        ms = statistics.median(graph_us([lambda: module.chained_prefill(*args[:7], config)] * 20) / 1e3
                               for _ in range(3))
        rows[name] = (mismatches, worst, ms)
        print(f"{name:12s} mismatching calls {mismatches:4d} of {CALLS * len(cases)}  rel diff to 'loads' "
              f"{worst:.2e}  graph ms (4 chunks, init) {ms:.4f}", flush=True)
    if "--apply" in sys.argv:
        clean = [name for name, (bad, _, _) in rows.items() if bad == 0]
        chosen = min(clean, key=lambda name: rows[name][2]) if clean else None
        print(f"chosen: {chosen}")
        with open(os.path.join(os.environ.get("OUT", "."), "chosen.txt"), "w") as f:
            f.write(f"{chosen}\n")
        if chosen is not None:
            with open(PACKAGE, "w") as f:
                f.write(variant_sources(source)[chosen])
    for name in modules:
        os.remove(os.path.join(os.path.dirname(PACKAGE), "_race_" + name.replace("+", "_") + ".py"))


if __name__ == "__main__":
    main()
