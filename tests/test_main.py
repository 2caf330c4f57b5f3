"""The main command on a CPU-only machine: what it checks and that its checks can fail."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2 import __main__ as cli
from tilegym_mamba2.core.toolchain import find_toolchain


def test_layer_example_on_cpu_matches_the_definition(capsys):
    err = cli.layer_example("cpu")
    assert err < 1e-5
    assert "pytorch backend" in capsys.readouterr().out


@pytest.mark.parametrize("broken_output", [0, 1], ids=["out", "varlen_states"])
def test_layer_example_reports_nan_as_failure(monkeypatch, broken_output):
    import tilegym_mamba2
    real = tilegym_mamba2.mamba_chunk_scan_combined

    def broken(*args, **kwargs):
        result = list(real(*args, **kwargs))
        result[broken_output] = torch.full_like(result[broken_output], float("nan"))
        return tuple(result)
    monkeypatch.setattr(tilegym_mamba2, "mamba_chunk_scan_combined", broken)
    err = cli.layer_example("cpu")
    assert not err <= 1e-2  # NaN compares false: the caller's check must fail it


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the main command")
@pytest.mark.skipif(find_toolchain().tileiras is None, reason="tileiras not installed")
def test_main_command_on_cpu(capsys):
    assert cli.run() == 0
    out = capsys.readouterr().out
    assert "No GPU" in out and "mamba_chunk_scan_combined" in out
    for kernel in ("compute_out_kernel", "varlen_states_kernel", "sequence_init_kernel"):
        assert kernel in out


def test_our_commands_keep_tilegyms_optional_backend_warnings_out_and_ours_in():
    """tilegym's import warnings about its Triton and TileCpp backends are not ours to act on:
    `python -m tilegym_mamba2 --help` prints none; a library import still shows tilegym's."""
    import subprocess
    import sys
    pytest.importorskip("tilegym")
    command = subprocess.run([sys.executable, "-m", "tilegym_mamba2", "--help"], capture_output=True, text=True,
                             timeout=300)
    assert command.returncode == 0, command.stderr
    for message in tilegym_mamba2.TILEGYM_OPTIONAL_BACKEND_WARNINGS:
        assert message not in command.stderr, command.stderr
    ours = "import warnings; warnings.warn('a warning of ours')"
    library = subprocess.run([sys.executable, "-W", "always", "-c", f"import tilegym_mamba2; {ours}"],
                             capture_output=True, text=True, timeout=300)
    assert "a warning of ours" in library.stderr


@pytest.mark.parametrize("target", ["sm_xx", "90", "sm_", "sm_9x"])
def test_a_bad_compile_target_is_refused_naming_the_flag(target, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compile", "--target", target])
    assert exit_.value.code == 2
    assert "--target must be sm_ and a compute capability" in capsys.readouterr().err
