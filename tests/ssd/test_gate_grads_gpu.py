"""The gate kernels (ssd/gate_grads.py) against float64 on random inputs, outputs poisoned with
NaN first: every head size (padded tiles), D per head, per channel or absent, strided inputs."""
import pytest
import torch

from tilegym_mamba2.ssd.gate_grads import gate_dy, gate_dz
from tilegym_mamba2.runtime.launch import poisoned_outputs
from tilegym_mamba2.ssd.reference.gate_grads import gate_dy_reference, gate_dz_reference
from tilegym_mamba2.testing import relative_error

SHAPES = [(2, 300, 8, 64), (1, 77, 3, 48), (1, 5, 80, 128), (3, 10, 2, 6)]


def _inputs(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def randn(*s):
        return torch.randn(*s, generator=g, device="cuda")
    return {name: (3 * randn(*shape)).to(dtype) for name in ("dout", "z", "y", "x")}, randn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dy_is_the_gradient_in_two_terms(shape, dtype):
    t, _ = _inputs(shape, dtype, 1)
    with poisoned_outputs():
        high, low = gate_dy(t["dout"], t["z"], dtype)
    exact = gate_dy_reference(t["dout"].double(), t["z"].double(), torch.float64)[0]
    assert high.dtype == dtype and high.shape == shape
    if dtype == torch.float32:
        assert low is None
        assert relative_error(high, exact) < 1e-5
    else:
        # The two terms together carry dy to fp32's precision, far below one rounding to 16 bits.
        assert relative_error(high.double() + low.double(), exact) < 1e-5
        assert relative_error(high, exact) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("skip", ["head", "channel", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dz_matches_float64(shape, dtype, skip):
    t, randn = _inputs(shape, dtype, 2)
    heads, width = shape[2], shape[3]
    d = None if skip is None else randn(heads, 1 if skip == "head" else width)
    with poisoned_outputs():
        dz = gate_dz(t["dout"], t["z"], t["y"], t["x"], d)
    exact = gate_dz_reference(t["dout"].double(), t["z"].double(), t["y"].double(), t["x"].double(),
                              None if d is None else d.double())
    assert dz.dtype == dtype and dz.shape == shape
    assert relative_error(dz, exact) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.gpu
def test_strided_inputs_are_read_as_their_values():
    """A z sliced out of a wider projection (as a mixer's zxbcdt split gives it) and a
    transposed dout: the same results as on dense copies."""
    shape = (2, 100, 8, 64)
    t, randn = _inputs(shape, torch.bfloat16, 3)
    wide = torch.randn(2, 100, 8, 3 * 64, device="cuda").to(torch.bfloat16)
    z = wide[..., 64:128]
    dout = t["dout"].transpose(0, 1).contiguous().transpose(0, 1)
    d = randn(8, 1)
    dense = gate_dz(t["dout"].contiguous(), z.contiguous(), t["y"], t["x"], d)
    assert torch.equal(gate_dz(dout, z, t["y"], t["x"], d), dense)
    assert all(torch.equal(a, b) for a, b in zip(gate_dy(dout, z, torch.bfloat16),
                                                 gate_dy(dout.contiguous(), z.contiguous(), torch.bfloat16)))
