"""TileGym's own mamba2 test file against this package, on any seeds (GPU).

    python benchmarks/tilegym_upstream.py TILEGYM/tests/ops/test_mamba2.py [--seeds 20]
        [--first-seed 0] [--spec theirs|ours] [--peer]

TILEGYM is a checkout of NVIDIA TileGym (the file imports its `tests` package: `common`,
`config`). The file itself stays where it is; this imports it. For each seed (42, the file's
own, then `--seeds` more from `--first-seed`) and each of its 9 shapes it runs

* the file's test bodies, `Test_Mamba2_ChunkForward.test_op` and `Test_Mamba2_ChunkBackward.test_op`,
  unchanged, with their `torch.manual_seed(42)` turned into the seed, and reports pass or the
  first failing line;
* the same checks measured: for every tolerance check of the backward test (dx, da, dd, ddt,
  dinit_state, then db and dc summed over each group's heads) and of the forward test (out,
  final_state), the worst ratio over the elements of |ours - reference| to the allowed
  atol + rtol |reference| (a ratio above 1 fails; NaN counts as infinite). `--peer` adds
  tilegym's own op (`backend="tilegym-cutile"`) on the same inputs, with its autotune off
  (`TILEGYM_DISABLE_AUTOTUNE=1`: its first configuration; a search takes minutes per shape).

`--spec ours` generates the inputs and references with this package's `Mamba2ProblemSpec` (float64
references) instead of the file's. It prints one line per shape and seed and a summary table of
the worst ratios per check, and exits non-zero if any test body failed.

`--pytest [ARGS]` instead runs the whole file under pytest (test_perf included), unchanged, after
`import tilegym_mamba2`; with `--spec ours` our spec replaces the file's in every test. It prints
test_perf's medians (the kernels' GPU time, CUPTI) as a table after pytest's summary, e.g.
`--pytest -q -k test_perf`.
"""
import argparse
import contextlib
import functools
import importlib
import os
import pathlib
import sys
import traceback
from unittest import mock

import torch

os.environ.setdefault("TILEGYM_DISABLE_AUTOTUNE", "1")

import tilegym  # noqa: E402

import tilegym_mamba2  # noqa: E402  (registers the backends)
from tilegym_mamba2.testing import Mamba2ProblemSpec as OurSpec  # noqa: E402

# The file's checks: (name, result index, reference key, atol, rtol, summed over a group's heads).
BACKWARD_CHECKS = [("dx", 0, "dx", 4e-2, 4e-2, False), ("da", 1, "da", 1e-2, 1e-2, False),
                   ("dd", 4, "dd", 1e-2, 1e-2, False), ("ddt", 5, "ddt", 8e-2, 8e-2, False),
                   ("dinit_state", 6, "dinit_state", 1e-2, 1e-2, False),
                   ("db", 2, "db", 5e-2, 4e-2, True), ("dc", 3, "dc", 4e-2, 4e-2, True)]
FORWARD_CHECKS = [("out", 0, "out", 2e-2, 2e-2, False), ("final_state", 1, "final_state", 1e-2, 1e-2, False)]
FILE_SEED = 42


def load(test_file):
    """The upstream module, imported as tests.ops.test_mamba2 of its checkout."""
    path = pathlib.Path(test_file).resolve()
    root = path.parents[2]
    sys.path.insert(0, str(root))
    for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
        del sys.modules[name]  # a `tests` from elsewhere on the path
    return importlib.import_module(f"tests.{path.parent.name}.{path.stem}")


@contextlib.contextmanager
def reference_math():
    """What the file's _ieee_reference_math fixture sets around each test."""
    previous = torch.get_float32_matmul_precision()
    old_env = os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
    os.environ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "0"
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
        if old_env is None:
            os.environ.pop("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", None)
        else:
            os.environ["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = old_env


@contextlib.contextmanager
def seeded(seed):
    """The test bodies call torch.manual_seed(42): seed them with ``seed`` instead."""
    real = torch.manual_seed
    with mock.patch.object(torch, "manual_seed", lambda _: real(seed)):
        yield


def worst_ratio(actual, reference, atol, rtol):
    """max |actual - reference| / (atol + rtol |reference|); inf where either is not finite."""
    actual, reference = actual.double(), reference.double()
    ratio = (actual - reference).abs() / (atol + rtol * reference.abs())
    ratio = torch.where(torch.isfinite(ratio), ratio, torch.inf)
    return ratio.max().item()


def our_spec(seed):
    """Our spec as the bodies construct it (positionally), seeded by its ``seed`` field, which
    torch.manual_seed does not reach."""
    return functools.partial(OurSpec, seed=seed)


def measured(spec_class, shape, seed, backend):
    """{check name: worst ratio} of the forward and backward ops on the inputs for ``seed``."""
    batch, tokens, groups, heads, state, head, chunk = shape
    torch.manual_seed(seed)
    spec = spec_class(batch, tokens, groups, heads, state, head, chunk, torch.bfloat16, torch.float32)
    with reference_math(), torch.no_grad():
        r = spec.get_sample_inputs()
        forward_args = [r[k] for k in ("x", "a", "b", "c", "d", "dt", "init_state")]
        ratios = {}
        result = tilegym.ops.mamba2_chunk_forward(*forward_args, chunk_size=chunk, backend=backend)
        for name, index, key, atol, rtol, _ in FORWARD_CHECKS:
            ratios[name] = worst_ratio(result[index], r[key], atol, rtol)
        result = tilegym.ops.mamba2_chunk_backward(*forward_args, r["dout"], r["dfinal_state"], chunk_size=chunk,
                                                   backend=backend)
        for name, index, key, atol, rtol, grouped in BACKWARD_CHECKS:
            reference = r[key]
            if grouped and reference.shape[2] != groups:  # the file's references are per head
                reference = reference.reshape(batch, tokens, groups, heads // groups, state).double().sum(3)
            ratios[name] = worst_ratio(result[index], reference, atol, rtol)
        ratios["dtypes"] = " ".join(str(t.dtype).removeprefix("torch.") for t in result)
    return ratios


def run_bodies(module, spec_class, shape, seed):
    """The file's two test_op bodies for ``shape`` on ``seed`` with ``spec_class`` as its spec:
    "pass" or the failure's first line."""
    verdicts = []
    module.Mamba2ProblemSpec = spec_class
    for cls in (module.Test_Mamba2_ChunkForward, module.Test_Mamba2_ChunkBackward):
        case = cls()
        try:
            with reference_math(), seeded(seed):
                cls.test_op(case, *shape, torch.bfloat16, "sm90", "cutile")
            verdicts.append("pass")
        except Exception as error:  # noqa: BLE001  (reported, counted as a failure)
            lines = [line for line in traceback.format_exception_only(error)[-1].splitlines() if line.strip()]
            verdicts.append(f"FAIL {lines[0][:160] if lines else type(error).__name__}")
    return verdicts


class WholeFile:
    """pytest plugin for --pytest: swaps our spec in (``ours``) and collects test_perf's medians."""

    def __init__(self, spec):
        self.spec, self.params, self.medians = spec, {}, {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            if self.spec == "ours":
                item.module.Mamba2ProblemSpec = OurSpec
            self.params[item.nodeid] = getattr(getattr(item, "callspec", None), "params", {})

    def pytest_runtest_logreport(self, report):
        if report.when != "call":
            return
        for key, value in report.user_properties:
            if key == "benchmark":  # {framework: {"forward": {"median": ms, ...}}}
                self.medians[report.nodeid] = next(iter(value.values()))["forward"]["median"]

    def table(self):
        """test_perf's medians (GPU ms from CUPTI: the kernels' time) per class, T and S."""
        rows = ["| test | T | S | median ms |", "| --- | --- | --- | --- |"]
        for nodeid, ms in self.medians.items():
            cls = nodeid.split("::")[1].removeprefix("Test_Mamba2_Chunk")
            params = self.params.get(nodeid, {})
            rows.append(f"| {cls} | {params.get('T', '?')} | {params.get('S', '?')} | {ms:.4f} |")
        return "\n".join(rows)


def run_whole_file(test_file, spec, pytest_args):
    """The whole file under pytest, unchanged, after ``import tilegym_mamba2``."""
    import pytest
    plugin = WholeFile(spec)
    root = pathlib.Path(test_file).resolve().parents[2]
    code = pytest.main([str(pathlib.Path(test_file).resolve()), "--rootdir", str(root), "-p", "no:cacheprovider",
                        *pytest_args], plugins=[plugin])
    if plugin.medians:
        print(plugin.table())
    return int(code)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--spec", choices=("theirs", "ours"), default="theirs")
    parser.add_argument("--peer", action="store_true", help="also tilegym's own op, autotune off")
    parser.add_argument("--pytest", nargs=argparse.REMAINDER,
                        help="instead: the whole file under pytest with these arguments (test_perf included)")
    args = parser.parse_args()
    if args.pytest is not None:
        sys.exit(run_whole_file(args.test_file, args.spec, args.pytest))
    module = load(args.test_file)
    theirs = module.Mamba2ProblemSpec
    tilegym.set_backend("cutile")
    shapes = [tuple(p.values) for p in module._E2E_SHAPE_CONFIGS]
    names = [p.id for p in module._E2E_SHAPE_CONFIGS]
    seeds = [FILE_SEED] + [s for s in range(args.first_seed, args.first_seed + args.seeds) if s != FILE_SEED]
    backends = ["cutile"] + (["tilegym-cutile"] if args.peer else [])
    worst = {b: {} for b in backends}
    failures = 0
    for seed in seeds:
        for name, shape in zip(names, shapes):
            spec_class = our_spec(seed) if args.spec == "ours" else theirs
            verdicts = run_bodies(module, spec_class, shape, seed)
            failures += sum(v != "pass" for v in verdicts)
            line = [f"seed {seed:3d} {name:20s} forward {verdicts[0]}, backward {verdicts[1]}"]
            for backend in backends:
                ratios = measured(spec_class, shape, seed, backend)
                dtypes = ratios.pop("dtypes")
                for check, value in ratios.items():
                    previous = worst[backend].get(check, (-1.0, None))
                    if value > previous[0]:
                        worst[backend][check] = (value, f"{name} seed {seed}")
                line.append(f"  {backend}: " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items())
                            + f" [{dtypes}]")
            print("\n".join(line), flush=True)
    print(f"\nspec: {args.spec}; seeds: {len(seeds)}; test bodies failed: {failures} of {2 * len(seeds) * len(shapes)}")
    print("worst |error| / allowed over every shape and seed (above 1 fails):")
    print("| check | " + " | ".join(backends) + " |")
    print("| --- |" + " --- |" * len(backends))
    for check, _, _, _, _, _ in FORWARD_CHECKS + BACKWARD_CHECKS:
        cells = [f"{worst[b][check][0]:.3f} ({worst[b][check][1]})" for b in backends]
        print(f"| {check} | " + " | ".join(cells) + " |")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
