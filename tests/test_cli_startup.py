"""The command line answers --help and usage errors before importing anything heavy: its parser
and argument checks need none of torch, tilegym, transformers or cuda.tile (read from
``python -X importtime``, which lists every module a process imports)."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "tilegym", "transformers", "cuda")
SUBCOMMANDS = ("run", "check", "compile", "bench", "tune", "registry", "fuzz")


def _imported(*argv):
    """(exit status, stderr, the modules the command imported)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tilegym_mamba2", *argv],
                          capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    modules.discard("imported package")  # importtime's header line
    return proc.returncode, proc.stderr, modules


def _heavy(modules):
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize("argv", [("--help",), *((name, "--help") for name in SUBCOMMANDS)])
def test_help_imports_nothing_heavy(argv):
    status, _, modules = _imported(*argv)
    assert status == 0
    assert "tilegym_mamba2" in modules and "argparse" in modules      # the listing is read right
    assert _heavy(modules) == []


@pytest.mark.parametrize("argv,message", [
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    (("--bogus",), "unrecognized arguments: --bogus"),
    (("fuzz", "--seconds", "-1"), "--seconds must be a finite number > 0"),
    (("bench", "--json", "/nonexistent/x.json"), "--json names a file in '/nonexistent', which does not exist"),
    (("bench", "--check", "--doc", "/nonexistent/performance.md"), "--doc must name an existing file"),
    (("compile", "--target", "gpu"), "--target must be sm_"),
])
def test_usage_errors_answer_before_any_heavy_import(argv, message):
    status, stderr, modules = _imported(*argv)
    assert status == 2 and message in stderr, stderr[-2000:]
    assert _heavy(modules) == []


def test_a_command_still_imports_what_it_runs():
    status, stderr, modules = _imported("registry")
    assert status == 0, stderr[-2000:]
    assert "torch" in modules and "tilegym" in modules      # load() ran: the registry is tilegym's
