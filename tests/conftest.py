import gc
import os
import random
import tempfile
import zlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without CUDA; stress tests (many seeds, big shapes, long sequences) run only
    when the -m expression names them: `python -m pytest -m "gpu and stress" tests`."""
    wants_stress = "stress" in (config.option.markexpr or "")
    no_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available); run `pytest -m gpu` on a GPU machine")
    not_asked = pytest.mark.skip(reason='a stress test: run with -m "gpu and stress" (or -m stress)')
    for item in items:
        if "stress" in item.keywords and not wants_stress:
            item.add_marker(not_asked)
        elif "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)


WORKERS_ENV = "TILEGYM_MAMBA2_TEST_WORKERS"


def worker_count():
    """Processes to spread the tests over: TILEGYM_MAMBA2_TEST_WORKERS if set (0: one process),
    else on a GPU machine all cores but two, up to 16: the GPU tests' time is mostly compiling
    kernels, one tileiras process at a time per test process, so it shrinks with cores (figures
    in docs/design.md). Without a GPU one process."""
    chosen = os.environ.get(WORKERS_ENV)
    if chosen is not None:
        if not chosen.isdigit():
            raise pytest.UsageError(f"{WORKERS_ENV} must be a whole number of processes, got {chosen!r}")
        return int(chosen)
    if not torch.cuda.is_available():
        return 0
    return max(2, min(16, (os.cpu_count() or 1) - 2))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Spreads the run over worker_count() processes with pytest-xdist (installed by the `test`
    extra) unless -n was given, it is a worker, or a debugger or collection-only run asked."""
    if (hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist")
            or config.option.numprocesses is not None or config.option.collectonly or config.option.usepdb):
        return
    workers = worker_count()
    if workers:
        config.option.numprocesses = workers
        if config.option.dist == "no":
            config.option.dist = "worksteal"  # uneven tests (5 s to 3 min): idle workers take queued ones


def pytest_configure(config):
    """Tuned choices go to a cache of the test run's own, not the user's; kernels use their
    shipped or heuristic configs (no timing of candidates) except in the tuning tests, which
    switch tuning on themselves, so that each kernel compiles once per shape."""
    os.environ["TILEGYM_MAMBA2_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilegym-mamba2-tuning-")
    os.environ.setdefault("TILEGYM_MAMBA2_TUNE", "0")
    # The suite compiles many shapes: compiling each one's other token-count classes in the
    # background too would multiply its compiles (the tests of that path switch it on themselves).
    os.environ.setdefault("TILEGYM_MAMBA2_PRECOMPILE", "0")


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test starts torch's and Python's global generators from a seed of its own id: the
    same draws on every run, whatever ran before it."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    yield


PEAK = "gpu_peak_bytes"


@pytest.fixture(autouse=True)
def _gpu_memory_returned(request):
    """Each test's GPU memory goes back to the device when it ends. The caching allocator would
    keep a test's peak reserved in its worker for the rest of the run: 14 workers on an 80 GB
    card then held 79 GB between them (one 19.7 GB, one 14.9 GB) and 15 tests failed for want
    of memory. The test's peak is reported at the end (pytest_terminal_summary)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        request.node.user_properties.append((PEAK, torch.cuda.max_memory_reserved()))
        gc.collect()
        torch.cuda.empty_cache()


_peaks = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == PEAK:
            _peaks[report.nodeid] = max(value, _peaks.get(report.nodeid, 0))


def pytest_terminal_summary(terminalreporter):
    """The tests that reserved the most GPU memory (this process's allocator; the spawned ranks of
    the context-parallel tests are not counted)."""
    if not _peaks:
        return
    terminalreporter.section("largest GPU memory reserved per test")
    for nodeid, peak in sorted(_peaks.items(), key=lambda kv: -kv[1])[:8]:
        terminalreporter.write_line(f"{peak / 2 ** 30:7.2f} GiB  {nodeid}")


@pytest.fixture(scope="module")
def fresh_compile_cache(tmp_path_factory):
    """Points cuTile's disk cache at an empty directory for this module, the way
    ct.compiler_timeout changes the context's config."""
    try:
        from cuda.tile._cext import default_tile_context
        config = default_tile_context.config
        previous = config.cache_dir
    except (ImportError, AttributeError):  # another cuTile layout: keep its cache
        yield
        return
    config.cache_dir = str(tmp_path_factory.mktemp("cutile-cache"))
    try:
        yield
    finally:
        config.cache_dir = previous
