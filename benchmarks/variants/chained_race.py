"""Experiments 79b and 81 (GPU): why the chained kernel's TMA form varies between runs.

run91: with the staged sums loaded through TMA (168 registers, 192 bytes of stack, 0.046 ms of
kernel against 0.076 for the package's ordinary loads), three GPU tests saw the final state
differ between repeated calls of the same inputs while the outputs stayed equal to the bit.
Each form below is the package's kernel edited as text, written next to the package module and
imported from there (removed after):
  loads         the package as it is: the sums' loads ordinary (its runs never varied)
  tma           the sums loaded through TMA (the form that varies)
  final         tma, the final state's store ordinary
  final+sums    that and the staged sums' stores ordinary
  late_final    tma, the final state stored after the outputs' phase
  pair_tma      tma, dt and the sums in one (2, 1, 1, chunk) load
  dtg_tma       tma, step 1's strided dt column by ct.gather (no asynchronous copy)
  msum_tma      tma, step 1's decay sums as masked row sums instead of ct.cumsum
  hsum_tma      the same in two levels (16-token parts, then the parts' totals)

Default (experiment 79b): CALLS repeats of one input per case, unpoisoned, each against the
first call; then graph time. --apply writes the fastest form without a mismatch over the package
module (this machine only; $OUT/chosen.txt). Such repeats cannot see what varies (run92).
--diagnose (experiment 81; VARIANTS, TRIALS): the calls as the GPU tests make them, see
diagnose(); it found a last-bit variation starting in the own-state phase of every TMA form
(run95-run99, benchmarks/NOTES.md). --write NAME: that form over the package module.
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
DT_LOAD = ("        dt_tile = ct.load(dt, (batch, chunk, head), (1, chunk_size, 1), padding_mode=zero).astype(\n"
           "            ct.float32).reshape((chunk_size,))\n")


def ordinary(call: str) -> str:
    return call[:-1] + ", allow_tma=False)"


def variant_sources(source: str) -> dict:
    """The package keeps ordinary sums loads (its "loads" form); the others load them through TMA."""
    def edit(text, old, new):
        assert text.count(old) == 1, old
        return text.replace(old, new)
    ordinary_loads = "(1, 1, 1, chunk_size), allow_tma=False).reshape("
    assert source.count(ordinary_loads) == 2, "the package's sums loads changed"
    tma = source.replace(ordinary_loads, "(1, 1, 1, chunk_size)).reshape(")
    final = edit(tma, FINAL, ordinary(FINAL))
    final_sums = final
    for store in SUMS_STORES:
        final_sums = edit(final_sums, store, ordinary(store))
    late = edit(tma, "    else:\n        " + FINAL + "\n", "")
    late = edit(late, "\n\n\nclass Workspace", "\n    if last >= num_chunks:  # after the outputs' phase\n        "
                + FINAL + "\n\n\nclass Workspace")
    two_loads = ("        dt_tile = ct.load(sums, (0, batch, head, chunk), (1, 1, 1, chunk_size)).reshape(\n"
                 "            (chunk_size,))\n"
                 "        g = ct.load(sums, (1, batch, head, chunk), (1, 1, 1, chunk_size)).reshape((chunk_size,))\n")
    pair = edit(tma, two_loads,
                "        both = ct.load(sums, (0, batch, head, chunk), (2, 1, 1, chunk_size)).reshape((2, chunk_size))\n"
                "        dt_tile = ct.extract(both, (0, 0), (1, chunk_size)).reshape((chunk_size,))\n"
                "        g = ct.extract(both, (1, 0), (1, chunk_size)).reshape((chunk_size,))\n")
    # Experiment 81c: step 1's strided dt column by ct.gather (plain loads into registers) instead
    # of the tile load the compiler turns into an asynchronous copy (LDGSTS) through shared memory.
    gathered = edit(tma, DT_LOAD, "        dt_tile = ct.gather(dt, (batch, chunk * chunk_size + ct.arange(chunk_size, "
                                  "dtype=ct.int32), head)).astype(\n            ct.float32)\n")
    # Experiment 81d: step 1's decay sums as masked row sums (fixed-order butterflies) instead of
    # ct.cumsum, whose cross-warp scan the warp-specialized schedule might associate differently.
    # run98 saw no variation in 100 repeats, run99 5 in 30: rarer, not gone.
    masked = edit(tma, "        g = ct.cumsum(dt_tile * a_head, axis=0) * LOG2E\n",
                  "        steps = dt_tile * a_head\n"
                  "        lower = ct.arange(chunk_size, dtype=ct.int32)[:, None] >= ct.arange(chunk_size, "
                  "dtype=ct.int32)[None, :]\n"
                  "        g = ct.sum(ct.where(lower, steps[None, :], 0.0), axis=1) * LOG2E\n")
    # The same in two levels: prefixes within 16-token parts, then over the parts' totals.
    parts = edit(tma, "        g = ct.cumsum(dt_tile * a_head, axis=0) * LOG2E\n",
                 "        steps = (dt_tile * a_head).reshape((chunk_size // 16, 16))\n"
                 "        pos = ct.arange(16, dtype=ct.int32)\n"
                 "        part = ct.arange(chunk_size // 16, dtype=ct.int32)\n"
                 "        within = ct.sum(ct.where((pos[:, None] >= pos[None, :])[None, :, :], steps[:, None, :], 0.0), "
                 "axis=2)\n"
                 "        before = ct.sum(ct.where(part[:, None] > part[None, :], ct.sum(steps, axis=1)[None, :], 0.0), "
                 "axis=1)\n"
                 "        g = ((within + before[:, None]) * LOG2E).reshape((chunk_size,))\n")
    return {"tma": tma, "final": final, "final+sums": final_sums, "late_final": late, "pair_tma": pair,
            "dtg_tma": gathered, "msum_tma": masked, "hsum_tma": parts, "loads": source}


def load_variant(name: str, source: str):
    module = "_race_" + name.replace("+", "_")
    with open(os.path.join(os.path.dirname(PACKAGE), module + ".py"), "w") as f:
        f.write(source)
    return importlib.import_module("tilegym_mamba2.cutile." + module)


def inputs(with_init: bool, seed: int = 0):
    """The prefill's checked arguments (a list; the initial state None without one)."""
    spec = Mamba2ProblemSpec.from_shape((1, 2048, 1, 32, 128, 64), chunk_size=128, device="cuda", seed=seed)
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


def published(module, args, config):
    """The call's published states (segment, row and head, P, N) from the module's workspace."""
    (workspace,) = module._workspaces.values()
    return workspace.for_shape(args[0].shape, args[2].shape[3], config.chunk_size, config.chunks_per_segment,
                               config.out_head_tile)[2].clone()


def segments_differing(got, want):
    """The segments (the last never publishes) whose published states differ, with element counts."""
    differ = (got[:-1] != want[:-1]).flatten(1).sum(1)
    return {segment: int(count) for segment, count in enumerate(differ.tolist()) if count}


def diagnose():
    """As the GPU tests call it (run91-93 failed there, never in main()'s repeats of one input):
    fresh inputs per trial, outputs poisoned, one call, a synchronize, five more calls; every call
    compared to the "loads" form on the same inputs: which final-state and output elements differ,
    NaN or values, which heads and rows, whether the trial's first call or a repeat differs, and
    which segments' published states (the chain's hops) differ. Then each form's graph time."""
    from tilegym_mamba2.cutile.launch import poisoned_outputs
    names = os.environ.get("VARIANTS", "tma,late_final,pair_tma").split(",")
    source = open(PACKAGE).read()
    modules = {name: load_variant(name, text) for name, text in variant_sources(source).items()
               if name in names + ["loads"]}
    base = choose_config(1, 2048, 1, 32, 64, 128, 128)
    trials = int(os.environ.get("TRIALS", 24))
    for name in names:
        module, bad_first, bad_repeat, chain, unstable = modules[name], 0, 0, 0, 0
        for trial in range(trials):
            per_segment, with_init = (2, 4)[trial % 2], trial % 4 < 2
            seed = int.from_bytes(os.urandom(4), "little")
            args = inputs(with_init, seed)
            config = chained_config(base, per_segment)
            with poisoned_outputs():
                want = modules["loads"].chained_prefill(*args[:7], config)
                want_published = published(modules["loads"], args, config)
                calls, hops = [module.chained_prefill(*args[:7], config)], []
                hops.append(published(module, args, config))
                for _ in range(5):
                    calls.append(module.chained_prefill(*args[:7], config))
                    hops.append(published(module, args, config))
                torch.cuda.synchronize()
            for index, ((out, final), hop) in enumerate(zip(calls, hops)):
                lines = [describe(final, want[1], want[1], "final"), describe(out, want[0], want[0], "out")]
                segments = segments_differing(hop, want_published)
                unstable += not (torch.equal(out, calls[0][0]) and torch.equal(final, calls[0][1])
                                 and torch.equal(hop[:-1], hops[0][:-1]))
                chain += bool(segments)
                if any(lines) or segments:
                    bad_first += index == 0
                    bad_repeat += index > 0
                    print(f"{name} trial {trial} seed {seed} ({per_segment} chunks/segment, init {with_init}) "
                          f"call {index}: published segments differing {segments}; "
                          + "; ".join(line for line in lines if line), flush=True)
        args, config = inputs(True, 1), chained_config(base, 4)
        ms = statistics.median(graph_us([lambda: module.chained_prefill(*args[:7], config)] * 20) / 1e3
                               for _ in range(3))
        print(f"## {name}: {trials} trials: first calls differing from 'loads' {bad_first}, repeats {bad_repeat}, "
              f"calls with published states differing {chain}; repeats differing from the trial's first call "
              f"{unstable}; graph ms (4 chunks, init) {ms:.4f}", flush=True)
    for name in modules:
        os.remove(os.path.join(os.path.dirname(PACKAGE), "_race_" + name.replace("+", "_") + ".py"))


def write(name: str):
    """--write NAME: the variant replaces the package module (on the device machine, for its tests)."""
    text = variant_sources(open(PACKAGE).read())[name]
    with open(PACKAGE, "w") as f:
        f.write(text)
    print(f"package module is now the {name!r} variant")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write(sys.argv[sys.argv.index("--write") + 1])
    elif "--diagnose" in sys.argv:
        diagnose()
    else:
        main()
