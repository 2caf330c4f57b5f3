"""`python -m tilegym_mamba2 fuzz`: on the CPU (pytorch backend) it passes, and it finds what it
is for: a wrong result, a crash instead of a clear error, a state written before an error."""
import re

import torch

import tilegym_mamba2
from tilegym_mamba2 import fuzz as fuzzing


def test_a_few_seconds_of_every_kind_pass():
    lines = []
    assert fuzzing.fuzz(seconds=3, log=lines.append) == 0
    counts = dict(re.findall(r"(layer|serving|malformed) (\d+)", lines[-1]))
    assert set(counts) == {"layer", "serving", "malformed"} and min(map(int, counts.values())) > 0, lines[-1]


def test_a_wrong_result_is_found_and_its_seed_replays_it(monkeypatch):
    real = tilegym_mamba2.mamba_chunk_scan_combined

    def off_by_a_percent(*args, **kwargs):
        out = real(*args, **kwargs)
        return (out[0] * 1.05, *out[1:]) if isinstance(out, tuple) else out * 1.05
    monkeypatch.setattr(tilegym_mamba2, "mamba_chunk_scan_combined", off_by_a_percent)
    lines = []
    assert fuzzing.fuzz(seconds=2, seed=None, log=lines.append) > 0
    seed = int(re.search(r"FAIL layer --seed (\d+)", "\n".join(lines)).group(1))
    assert fuzzing.fuzz(seed=seed, log=lambda _: None) == 1


def test_a_crash_or_a_write_before_an_error_is_found(monkeypatch):
    real = tilegym_mamba2.selective_state_update

    def writes_then_checks(state, *args, **kwargs):
        if isinstance(state, torch.Tensor):
            state.add_(1)
        return real(state, *args, **kwargs)
    monkeypatch.setattr(tilegym_mamba2, "selective_state_update", writes_then_checks)
    lines = []
    fuzzing.fuzz(seconds=2, log=lines.append)
    assert any("malformed" in line and "before raising" in line for line in lines), lines[-3:]


def test_the_command_line_runs_it():
    from tilegym_mamba2.__main__ import main
    assert main(["fuzz", "--seconds", "1"]) == 0
