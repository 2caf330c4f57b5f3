"""benchmarks/margins.py on the CPU through the pytorch backend: every output and gradient is
measured against its own reference (db and dc summed over each group's heads), so a float32
implementation sits far inside TileGym's tolerances, and a wrong gradient shows."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))

import margins  # noqa: E402

SHAPE = (2, 128, 2, 4, 16, 32, 64)  # batch, tokens, groups, heads, state, head, chunk


def test_every_output_and_gradient_is_measured_and_fp32_is_well_inside():
    ratios = margins.case_ratios(SHAPE, 0, -2.0, "pytorch")
    assert set(ratios) == set(margins.FORWARD + margins.BACKWARD)
    for name, ratio in ratios.items():
        # The pytorch backend's bf16 outputs are rounded once: at most 2^-8 / rtol of the allowed.
        assert 0.0 <= ratio < 0.25, (name, ratio)


def test_a_wrong_gradient_is_reported_above_one(monkeypatch):
    backward = margins.tilegym_mamba2.mamba2_chunk_backward

    def db_doubled(*args, **kwargs):
        grads = list(backward(*args, **kwargs))
        grads[2] = grads[2] * 2
        return tuple(grads)

    monkeypatch.setattr(margins.tilegym_mamba2, "mamba2_chunk_backward", db_doubled)
    ratios = margins.case_ratios(SHAPE, 0, 0.0, "pytorch")
    assert ratios["db"] > 1 and max(v for k, v in ratios.items() if k != "db") < 0.25, ratios
