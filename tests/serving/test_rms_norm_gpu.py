"""rms_norm's kernel on a GPU (skipped elsewhere): against the float64 reference and against
Hugging Face's own Mamba-2 norm modules, outputs poisoned with NaN before each call, fresh
random inputs (the seed is in the failure message)."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.runtime.launch import poisoned_outputs

from gpu_checks import fresh_seed, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}

CASES = {
    "decode_gated_2.7b": dict(shape=(1, 1, 5120), gated=True),
    "decode_batch64_block": dict(shape=(64, 1, 2560), gated=False),
    "prefill_gated": dict(shape=(2, 700, 5120), gated=True),
    "odd_width_groups": dict(shape=(3, 5, 1000), gated=True, group_size=250),
    "narrow_rows": dict(shape=(37, 96), gated=False),
    "wide_row": dict(shape=(2, 3, 12288), gated=True, group_size=3072),
    "prefill_block": dict(shape=(1, 2048, 2560), gated=False),             # four rows a block
    "many_grouped_rows": dict(shape=(600, 96), gated=True, group_size=32),  # a block's rows span groups
}


def inputs(shape, gated, dtype, weight_dtype, seed, strided_gate=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(*shape, generator=g, device="cuda") * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=g, device="cuda").to(weight_dtype)
    gate = None
    if gated:  # a slice of a wider projection, as the mixer passes its gate
        wide = torch.randn(*shape[:-1], shape[-1] + 40, generator=g, device="cuda").to(dtype)
        gate = wide[..., 24:24 + shape[-1]] if strided_gate else wide[..., :shape[-1]].contiguous()
    return x, weight, gate


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                (torch.float32, torch.float32)])
@pytest.mark.parametrize("case", list(CASES))
def test_rms_norm_matches_the_float64_reference(case, dtype, weight_dtype):
    seed = fresh_seed()
    spec = CASES[case]
    x, weight, gate = inputs(spec["shape"], spec["gated"], dtype, weight_dtype, seed)
    group_size = spec.get("group_size")
    with poisoned_outputs():
        out = tilegym_mamba2.rms_norm(x, weight, gate, 1e-5, group_size)
    ref = tilegym_mamba2.rms_norm(x.double(), weight.double(), None if gate is None else gate.double(), 1e-5,
                                  group_size, backend="pytorch")
    assert out.shape == x.shape and out.dtype == torch.promote_types(weight_dtype, dtype)
    # The value is rounded to x's dtype before the weight, so x's dtype bounds the error.
    tolerance = max(TOLERANCE[out.dtype], TOLERANCE[dtype])
    assert rel_err(out, ref) < tolerance, f"seed={seed}"
    # The pytorch backend on the same (rounded) inputs: its fp32 arithmetic and rounding points.
    same = tilegym_mamba2.rms_norm(x, weight, gate, 1e-5, group_size, backend="pytorch")
    assert rel_err(out, same) < tolerance / 4, f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_equals_hugging_faces_modules(dtype):
    modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    zamba2 = pytest.importorskip("transformers.models.zamba2.modeling_zamba2")
    seed = fresh_seed()
    x, weight, gate = inputs((4, 3, 5120), True, dtype, dtype, seed)
    gated = modeling.MambaRMSNormGated(5120, eps=1e-5).to("cuda", dtype)
    plain = modeling.Mamba2RMSNorm(5120, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        gated.weight.copy_(weight)
        plain.weight.copy_(weight)
        cases = [(gated(x, gate), tilegym_mamba2.rms_norm(x, weight, gate, 1e-5)),
                 (plain(x), tilegym_mamba2.rms_norm(x, weight, None, 1e-5))]
        # The hybrids' grouped gated norm (Zamba2's, NemotronH's): 8 groups of 640.
        grouped = zamba2.Zamba2RMSNormGated(5120, group_size=640, eps=1e-5).to("cuda", dtype)
        grouped.weight.copy_(weight)
        cases.append((grouped(x, gate), tilegym_mamba2.rms_norm(x, weight, gate, 1e-5, group_size=640)))
        for want, got in cases:
            assert got.dtype == want.dtype
            # A rounding or two apart at most: the sum of squares is added in another order.
            close = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-5
            assert ((got.double() - want.double()).abs() <= close * want.double().abs() + 1e-6).all(), f"seed={seed}"


def test_rms_norm_keeps_a_non_finite_row_to_itself():
    seed = fresh_seed()
    x, weight, gate = inputs((6, 2560), True, torch.bfloat16, torch.bfloat16, seed)
    x[2, 100] = float("nan")
    gate[4, 7] = float("inf")
    out = tilegym_mamba2.rms_norm(x, weight, gate, 1e-5)
    assert torch.isnan(out[2]).all()
    finite_rows = [0, 1, 3, 5]
    ref = tilegym_mamba2.rms_norm(x[finite_rows], weight, gate[finite_rows], 1e-5, backend="pytorch")
    assert torch.isfinite(out[finite_rows]).all()
    assert rel_err(out[finite_rows], ref) < 1e-2 / 4, f"seed={seed}"
