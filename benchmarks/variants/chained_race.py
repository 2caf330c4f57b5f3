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

run92: no variant mismatched here, yet the GPU tests (outputs poisoned with NaN before each call)
failed for every TMA-load variant: a repeat on an unpoisoned buffer cannot show an element the
kernel left unwritten (the allocator hands back the last call's buffer, holding the same bits).
--diagnose (the next call's probe): the "tma" and "final+sums" variants with poisoned outputs,
CALLS repeats per case; for each repeat that differs from the first, how many final-state
elements differ, how many of them are NaN (never written), and which heads and rows of the
state they are in, and the same for the outputs; each against the "loads" variant too.
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


def describe(got, first, want, name):
    """Where got differs from first (the call's first result): element counts, NaN among them,
    the heads and state rows involved; and its largest relative difference to want."""
    differ = ~((got == first) | (torch.isnan(got) & torch.isnan(first)))
    if not differ.any():
        return ""
    where = differ.nonzero()
    heads = sorted(set(where[:, 1 if got.ndim == 4 and name == "final" else 2].tolist()))
    rows = sorted(set(where[:, 2 if name == "final" else 1].tolist()))
    nan = int(torch.isnan(got[differ]).sum())
    rel = ((got.double() - want.double()).nan_to_num().norm() / want.double().norm()).item()
    return (f"{name}: {int(differ.sum())} differ ({nan} NaN), heads {heads[:8]}{'...' if len(heads) > 8 else ''}, "
            f"{'rows' if name == 'final' else 'tokens'} {rows[:6]}{'...' if len(rows) > 6 else ''} "
            f"({len(rows)}), rel to ordinary loads {rel:.1e}")


def diagnose():
    from tilegym_mamba2.cutile.launch import poisoned_outputs
    source = open(PACKAGE).read()
    modules = {name: load_variant(name, text) for name, text in variant_sources(source).items()
               if name in ("tma", "final+sums", "loads")}
    base = choose_config(1, 2048, 1, 32, 64, 128, 128)
    for per_segment in (2, 4):
        for with_init in (True, False):
            args = inputs(with_init)
            config = chained_config(base, per_segment)
            with poisoned_outputs():
                want = modules["loads"].chained_prefill(*args[:7], config)
                for name in ("tma", "final+sums"):
                    module = modules[name]
                    first = module.chained_prefill(*args[:7], config)
                    torch.cuda.synchronize()
                    print(f"## {name}, {per_segment} chunks/segment, init {with_init}: first call "
                          f"{describe(first[1], want[1], want[1], 'final') or 'final equal to ordinary loads'}; "
                          f"{describe(first[0], want[0], want[0], 'out') or 'out equal'}", flush=True)
                    bad = 0
                    for call in range(CALLS):
                        again = module.chained_prefill(*args[:7], config)
                        torch.cuda.synchronize()
                        lines = [describe(again[1], first[1], want[1], "final"),
                                 describe(again[0], first[0], want[0], "out")]
                        if any(lines):
                            bad += 1
                            if bad <= 5:
                                print(f"   call {call}: " + "; ".join(line for line in lines if line), flush=True)
                    print(f"   {bad} of {CALLS} repeats differ", flush=True)
    for name in modules:
        os.remove(os.path.join(os.path.dirname(PACKAGE), "_race_" + name.replace("+", "_") + ".py"))


if __name__ == "__main__":
    diagnose() if "--diagnose" in sys.argv else main()
