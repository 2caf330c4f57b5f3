"""The CPU replays of the kernels' roundings (benchmarks/forward_rounding.py,
backward_rounding.py): without roundings they give the float64 references back, and the
backward's reproduces the case the GPU tests measured."""
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))

import backward_rounding  # noqa: E402
import forward_rounding  # noqa: E402
from tilegym_mamba2.testing import Mamba2ProblemSpec  # noqa: E402

SHAPE = (2, 192, 2, 4, 32, 32, 64)  # batch, tokens, groups, heads, state, head, chunk: three chunks


# A bf16 output is off by at most 2^-8 of itself: against atol + rtol |ref| that is under 2^-8 / rtol.
OUTPUT_ROUNDING = 2.0 ** -8


def test_backward_replay_without_roundings_gives_the_references():
    """Only the bf16 outputs' rounding is left (dx, db, dc, ddt; da and dinit_state are not rounded)."""
    exact = {"states": "fp64", "walk": "fp64"}
    for seed, dt_shift in ((0, 0.0), (1, -2.0)):
        ratios = backward_rounding.ratios(SHAPE, seed, dt_shift, exact)
        assert set(ratios) == set(backward_rounding.TOLERANCE)
        for name, ratio in ratios.items():
            rtol = backward_rounding.TOLERANCE[name][1]
            assert ratio <= (OUTPUT_ROUNDING / rtol if name in ("dx", "db", "dc", "ddt") else 1e-6), (name, ratios)


def test_backward_replay_reproduces_the_gpu_tests_known_case():
    """dx at 1.18x and db at 0.65x the allowed error, as the kernels measured (tests/test_backward_gpu.py,
    KNOWN_MARGINS); with fp16 states dx comes well inside."""
    case = ((1, 256, 4, 4, 128, 64, 128), 745821642, 0.0)
    kernels = backward_rounding.ratios(*case, {"states": "bf16", "walk": "bf16"})
    assert 1.15 < kernels["dx"] < 1.21 and 0.63 < kernels["db"] < 0.67, kernels
    assert backward_rounding.ratios(*case, {"states": "fp16", "walk": "bf16"})["dx"] < 0.2


def test_forward_replay_without_roundings_gives_the_references():
    batch, tokens, groups, heads, state, head, chunk = SHAPE
    spec = Mamba2ProblemSpec(batch, tokens, groups, heads, state, head, chunk, torch.bfloat16, torch.float32,
                             device="cpu", seed=2, dt_shift=0.0)
    r = spec.get_sample_inputs(with_backward=False)
    exact = dict.fromkeys(forward_rounding.OPERANDS, "fp64")
    out, final = forward_rounding.replay(r["x"], r["a"], r["b"], r["c"], r["d"], r["dt"], r["init_state"], exact)
    assert forward_rounding.worst_ratio(out, r["out"], *forward_rounding.TOLERANCE["out"]) <= OUTPUT_ROUNDING / 2e-2
    assert forward_rounding.worst_ratio(final, r["final_state"], *forward_rounding.TOLERANCE["final_state"]) < 1e-6


@pytest.mark.parametrize("form", ["bf16", "fp16", "2bf16"])
def test_forward_replay_rounds_as_named(form):
    t = torch.randn(1000, dtype=torch.float64) * 3
    got = forward_rounding.rounded(t, form)
    scale = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "2bf16": 2.0 ** -16}[form]
    assert ((got - t).abs() <= scale * t.abs()).all() and not torch.equal(got, t)


def test_a_scaled_fp16_tile_keeps_gradients_of_a_small_loss():
    """Output gradients at 2^-24 (a power of two: dout's bf16 bits are kept): fp16 states lose the
    state gradients under its normal range, fp16 after a power-of-two scale per tile does not."""
    case = (SHAPE, 3, 0.0)
    small = 2.0 ** -24
    scaled = backward_rounding.ratios(*case, {"states": "fp16s", "walk": "fp16s"}, loss_scale=small)
    assert scaled == pytest.approx(backward_rounding.ratios(*case, {"states": "fp16s", "walk": "fp16s"}), abs=1e-9)
    assert max(backward_rounding.ratios(*case, {"states": "fp16", "walk": "fp16"}, loss_scale=small).values()) > 1
