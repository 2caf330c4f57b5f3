"""core/constants.py: the shared numbers mean what their comments say."""
import math

import torch
import torch.nn.functional as F

from tilegym_mamba2.core import constants as c


def test_the_kernels_shapes_fit_the_contracts():
    assert c.KERNEL_CHUNK in c.CHUNK_SIZES and c.MAX_STATE in c.TILE_DIMS
    assert c.SPLIT_STATE == 2 * c.MAX_STATE and c.SPLIT_STATE not in c.TILE_DIMS
    assert all(d & (d - 1) == 0 and d >= 16 for d in c.TILE_DIMS + c.CHUNK_SIZES)
    assert c.REFERENCE_INPUT_DTYPES[:len(c.INPUT_DTYPES)] == c.INPUT_DTYPES


def test_the_math_constants():
    v = torch.linspace(-30, 5, 50, dtype=torch.float64)
    assert torch.allclose(torch.exp2(v * c.LOG2E), torch.exp(v), rtol=1e-14)
    for dtype in (torch.float32, torch.float64):
        assert torch.exp(torch.tensor(c.LOG_DECAY_FLOOR, dtype=dtype)) == 0
    above = torch.tensor([c.SOFTPLUS_THRESHOLD + 0.5], dtype=torch.float32)
    assert F.softplus(above) == above and math.log1p(math.exp(c.SOFTPLUS_THRESHOLD)) - c.SOFTPLUS_THRESHOLD < 1e-8
    assert c.NO_LIMIT == (0.0, float("inf"))
