"""The one relative error: float64, and inf for a non-finite result, whatever surrounds it."""
import math

import torch

from tilegym_mamba2.testing import relative_error


def test_relative_error_is_the_norm_ratio_in_float64():
    ref = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    assert math.isclose(relative_error(torch.tensor([3.0, 4.5]), ref), 0.1, rel_tol=1e-12)
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0


def test_a_non_finite_result_is_infinitely_wrong_and_survives_max():
    ref = torch.ones(4)
    for bad in (float("nan"), float("inf"), -float("inf")):
        got = ref.clone()
        got[2] = bad
        err = relative_error(got, ref)
        assert err == float("inf")
        assert not err <= 1e-3 and max(0.5, err) == err and max(err, 0.5) == err
