"""The argument checks of mamba2_chunk_forward, directly and through the public op (CPU)."""

import pytest
import torch

from tilegym_mamba2.runtime import limits
import torch.nn.functional as F

import tilegym_mamba2
from tilegym_mamba2.backends.pytorch import mamba2_chunk_forward_pytorch
from tilegym_mamba2.ssd.reference.forward import token_recurrence
from tilegym_mamba2.core.validation import ForwardArgs, check_forward_args, values

B, T, G, H, P, N, L = 2, 20, 2, 4, 8, 16, 16


def make_inputs(batch=B, tokens=T, groups=G, heads=H, head_size=P, state_size=N,
                dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    return dict(
        x=randn(batch, tokens, heads, head_size).to(dtype),
        a=-(1 + 15 * torch.rand(heads, generator=gen)),
        b=randn(batch, tokens, groups, state_size).to(dtype),
        c=randn(batch, tokens, groups, state_size).to(dtype),
        d=randn(heads),
        dt=F.softplus(randn(batch, tokens, heads) - 2).to(dtype),
        init_state=randn(batch, heads, head_size, state_size),
        chunk_size=L,
    )


def check(**kw):
    return check_forward_args(**kw, limits=limits.PYTORCH)


def op(**kw):
    return tilegym_mamba2.mamba2_chunk_forward(**kw, backend="pytorch")


@pytest.fixture(params=[check, op], ids=["check_forward_args", "op"])
def call(request):
    return request.param


def with_(**changes):
    kw = make_inputs()
    kw.update(changes)
    return kw


# ---------------------------------------------------------------- valid inputs

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_valid_inputs_pass_and_are_normalised(dtype):
    kw = make_inputs(dtype=dtype)
    kw["a"], kw["d"] = kw["a"].double(), kw["d"].half()
    kw["init_state"] = kw["init_state"].double().transpose(2, 3).contiguous().transpose(2, 3)
    args = check(**kw)
    assert isinstance(args, ForwardArgs)
    for name in ("x", "a", "b", "c", "d", "dt", "init_state"):
        t = getattr(args, name)
        assert t.is_contiguous(), name
        torch.testing.assert_close(t.double(), kw[name].double(), rtol=1e-3, atol=0, msg=name)
    for name in ("a", "d", "init_state"):
        assert getattr(args, name).dtype == torch.float32, name
    for name in ("x", "b", "c", "dt"):
        assert getattr(args, name).dtype == dtype, name
    assert args.chunk_size == L


def test_init_state_none_passes():
    args = check(**with_(init_state=None))
    assert args.init_state is None


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128, 256])
def test_every_chunk_size_passes(chunk_size):
    assert check(**with_(chunk_size=chunk_size)).chunk_size == chunk_size


def test_op_result_shapes_and_dtypes():
    kw = make_inputs(dtype=torch.bfloat16)
    out, state = op(**kw)
    assert out.shape == (B, T, H, P) and out.dtype == torch.bfloat16
    assert state.shape == (B, H, P, N) and state.dtype == torch.float32


def _non_contiguous(t):
    """Same values, a transposed memory layout."""
    if t.ndim < 2:
        return t.repeat_interleave(2)[::2]
    nc = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not nc.is_contiguous() and torch.equal(nc, t)
    return nc


def test_non_contiguous_inputs_give_the_same_result():
    kw = make_inputs()
    nkw = {k: _non_contiguous(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    assert not any(nkw[k].is_contiguous() for k in ("x", "a", "b", "c", "d", "dt", "init_state"))
    args = check(**nkw)
    assert all(t.is_contiguous() for t in values(args) if isinstance(t, torch.Tensor))
    out, state = op(**kw)
    nout, nstate = op(**nkw)
    torch.testing.assert_close(nout, out, rtol=0, atol=0)
    torch.testing.assert_close(nstate, state, rtol=0, atol=0)


def test_one_token():
    kw = make_inputs(tokens=1)
    out, state = op(**kw)
    assert out.shape == (B, 1, H, P)
    ref_out, ref_state = token_recurrence(*(kw[k] for k in ("x", "a", "b", "c", "d", "dt", "init_state")))
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- type errors

@pytest.mark.parametrize("name", ["x", "a", "b", "c", "d", "dt", "init_state"])
@pytest.mark.parametrize("value", [[1.0, 2.0], 3.0, "x"], ids=["list", "float", "str"])
def test_non_tensor_argument(call, name, value):
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor"):
        call(**with_(**{name: value}))


def test_non_tensor_none_is_rejected_for_required_args(call):
    for name in ("x", "a", "b", "c", "d", "dt"):
        with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor"):
            call(**with_(**{name: None}))


@pytest.mark.parametrize("name", ["b", "c"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_b_c_dtype_must_match_x(call, name, dtype):
    kw = make_inputs()
    kw[name] = kw[name].to(dtype)
    with pytest.raises(TypeError, match=rf"^{name} must have x's dtype") as info:
        call(**kw)
    assert str(dtype) in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_x_dtype(call, dtype):
    kw = make_inputs()
    for name in ("x", "b", "c"):  # b and c follow x, so only x's own dtype check can fire
        kw[name] = kw[name].to(dtype)
    with pytest.raises(TypeError, match=r"^x must be bfloat16, float16, float32 or float64 for the pytorch backend, got"):
        call(**kw)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_x_dtype_cutile(dtype):
    """The cutile backend takes no float64; the dtype is checked before the device."""
    kw = make_inputs()
    for name in ("x", "b", "c"):
        kw[name] = kw[name].to(dtype)
    with pytest.raises(TypeError, match=rf"^x must be bfloat16, float16 or float32 for the cutile backend, "
                                        rf"got {dtype}"):
        check_forward_args(**kw, limits=limits.CUTILE)


def test_float64_inputs_stay_float64_on_pytorch():
    kw = make_inputs(dtype=torch.float64)
    kw["a"], kw["d"], kw["init_state"] = kw["a"].float(), kw["d"].half(), kw["init_state"].float()
    args = check(**kw)
    for name in ("x", "a", "b", "c", "d", "dt", "init_state"):
        assert getattr(args, name).dtype == torch.float64, name
    torch.testing.assert_close(args.a, kw["a"].double(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["dt", "a", "d", "init_state"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_non_float_side_inputs(call, name, dtype):
    kw = make_inputs()
    kw[name] = kw[name].to(dtype)
    with pytest.raises(TypeError, match=rf"^{name} must be a floating-point tensor"):
        call(**kw)


# ---------------------------------------------------------------- shape errors

RANK_CASES = {
    "x": torch.zeros(B, T, H * P),
    "b": torch.zeros(B, T, G * N),
    "c": torch.zeros(B, T, G, N, 1),
    "dt": torch.zeros(B, T, H, 1),
    "a": torch.zeros(H, 1),
    "d": torch.zeros(1, H),
    "init_state": torch.zeros(B, H, P * N),
}


@pytest.mark.parametrize("name", list(RANK_CASES))
def test_wrong_rank(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must be \[") as info:
        call(**with_(**{name: RANK_CASES[name]}))
    assert str(tuple(RANK_CASES[name].shape)) in str(info.value)


def test_scalar_x(call):
    with pytest.raises(ValueError, match=r"^x must be \[batch, tokens, heads, head_size\] \(4 dimensions\)"):
        call(**with_(x=torch.tensor(1.0)))


SHAPE_CASES = {
    "c": torch.zeros(B, T, G, N + 1),        # not the shape of b
    "dt": torch.zeros(B, T, H + 1),
    "a": torch.zeros(H + 1),
    "d": torch.zeros(H - 1),
    "init_state": torch.zeros(B, H, P, N + 1),
}


@pytest.mark.parametrize("name", list(SHAPE_CASES))
def test_wrong_shape(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must be \[") as info:
        call(**with_(**{name: SHAPE_CASES[name]}))
    assert str(tuple(SHAPE_CASES[name].shape)) in str(info.value)


@pytest.mark.parametrize("dim", ["batch", "tokens"])
@pytest.mark.parametrize("name", ["b", "c", "dt"])
def test_batch_tokens_must_match_x(call, name, dim):
    kw = make_inputs()
    other = make_inputs(batch=B + (dim == "batch"), tokens=T + 3 * (dim == "tokens"))
    if name == "c":
        # b matches x, c does not.
        kw["c"] = other["c"]
    elif name == "b":
        # b and c agree with each other but not with x.
        kw["b"], kw["c"] = other["b"], other["c"]
    else:
        kw["dt"] = other["dt"]
    with pytest.raises(ValueError, match=rf"^{name} must be \["):
        call(**kw)


def test_init_state_batch_must_match(call):
    with pytest.raises(ValueError, match=r"^init_state must be"):
        call(**with_(init_state=torch.zeros(B + 1, H, P, N)))


@pytest.mark.parametrize("groups", [3, 8])
def test_heads_multiple_of_groups(call, groups):
    kw = make_inputs(groups=groups, heads=H)
    with pytest.raises(ValueError, match=r"groups") as info:
        call(**kw)
    assert f"({H})" in str(info.value) and f"({groups})" in str(info.value)


@pytest.mark.parametrize("chunk_size", [0, -16, 8, 48, 100, 512, 128.0, True, "128", None, 2**40])
def test_chunk_size(call, chunk_size):
    with pytest.raises(ValueError, match=r"^chunk_size must be one of \(16, 32, 64, 128, 256\)") as info:
        call(**with_(chunk_size=chunk_size))
    assert repr(chunk_size) in str(info.value)


@pytest.mark.parametrize("dim", ["batch", "tokens", "heads", "head_size"])
def test_empty_x_dims(call, dim):
    sizes = dict(batch=B, tokens=T, heads=H, head_size=P, groups=1)
    sizes[dim] = 0
    with pytest.raises(ValueError, match=r"^x .* must have no empty dimension"):
        call(**make_inputs(**sizes))


def test_zero_groups(call):
    kw = make_inputs()
    kw["b"] = kw["c"] = torch.zeros(B, T, 0, N)
    with pytest.raises(ValueError, match=r"groups"):
        call(**kw)


def test_zero_state_size(call):
    with pytest.raises(ValueError, match=r"^state_size .* must be at least 1"):
        call(**make_inputs(state_size=0))


# ---------------------------------------------------------------- devices and backends

@pytest.mark.parametrize("name", ["x", "a", "b", "c", "d", "dt", "init_state"])
def test_tensors_on_different_devices(call, name):
    kw = make_inputs()
    kw[name] = torch.empty_like(kw[name], device="meta")  # "meta" fakes a second device
    with pytest.raises(ValueError, match=r"^all tensors must be on one device") as info:
        call(**kw)
    assert f"{name} on meta" in str(info.value)
    assert "x on cpu" in str(info.value) or name == "x"


def test_cutile_backend_needs_cuda_tensors():
    kw = make_inputs()
    with pytest.raises(ValueError, match=r"CUDA") as info:
        check_forward_args(**kw, limits=limits.CUTILE)
    assert 'backend="pytorch"' in str(info.value)
    # The pytorch backend takes the same tensors.
    check_forward_args(**kw, limits=limits.PYTORCH)


def test_op_picks_its_backend_by_device_and_backend_overrides():
    """One rule for every public function: CPU tensors run on the pytorch backend unless
    backend= names another, and the cutile backend refuses them, naming CUDA."""
    kw = make_inputs()
    out, final = tilegym_mamba2.mamba2_chunk_forward(**kw)
    want_out, want_final = tilegym_mamba2.mamba2_chunk_forward(**kw, backend="pytorch")
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
    with pytest.raises(ValueError, match=r"CUDA"):
        tilegym_mamba2.mamba2_chunk_forward(**kw, backend="cutile")
    with pytest.raises(ValueError, match=r"backend must be one of \['cutile', 'pytorch'\] .*'bogus'"):
        tilegym_mamba2.mamba2_chunk_forward(**kw, backend="bogus")
    with pytest.raises(ValueError, match=r"CUDA"):
        tilegym_mamba2.mamba2_chunk_forward(**make_inputs(), backend="cutile")


def test_pytorch_backend_checks_its_arguments():
    with pytest.raises(ValueError, match=r"^chunk_size"):
        mamba2_chunk_forward_pytorch(**with_(chunk_size=48))


def _layer_inputs(groups_b=G, groups_c=G):
    g = torch.Generator().manual_seed(3)
    return dict(x=torch.randn(B, T, H, P, generator=g), dt=torch.rand(B, T, H, generator=g), A=-torch.ones(H),
                B=torch.randn(B, T, groups_b, N, generator=g), C=torch.randn(B, T, groups_c, N, generator=g),
                chunk_size=16)


@pytest.mark.parametrize("wrong", ["B", "C"])
def test_the_one_of_B_and_C_with_a_bad_group_count_is_named(wrong):
    kw = _layer_inputs(**{f"groups_{wrong.lower()}": 3})
    with pytest.raises(ValueError, match=rf"^{wrong}'s groups \(3\), its third dimension, must divide heads \({H}\)"):
        tilegym_mamba2.mamba_chunk_scan_combined(**kw, backend="pytorch")


def test_x_in_heads_tokens_order_is_named_as_x():
    kw = _layer_inputs()
    kw["x"] = kw["x"].transpose(1, 2).contiguous()            # [batch, heads, tokens, head_size]
    with pytest.raises(ValueError, match=r"^x must be \[batch, tokens, heads, head_size\]; its shape .* reads as "
                                         r"\[batch, heads, tokens, head_size\]"):
        tilegym_mamba2.mamba_chunk_scan_combined(**kw, backend="pytorch")


def test_value_checks_on_request_name_a_and_dt(monkeypatch):
    kw = make_inputs()
    kw["a"] = torch.ones_like(kw["a"])                   # a >= 0: outputs grow without bound
    mamba2_chunk_forward_pytorch(**kw)                   # not checked by default (it would read the device)
    monkeypatch.setenv("TILEGYM_MAMBA2_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match=r"^a must be negative"):
        mamba2_chunk_forward_pytorch(**kw)
    kw = make_inputs()
    kw["dt"] = -kw["dt"].abs() - 0.1
    with pytest.raises(ValueError, match=r"^dt must be >= 0"):
        mamba2_chunk_forward_pytorch(**kw)
    layer = _layer_inputs()
    layer["A"] = torch.ones(H)
    with pytest.raises(ValueError, match=r"^A must be negative"):
        tilegym_mamba2.mamba_chunk_scan_combined(**layer, backend="pytorch")


@pytest.mark.parametrize("name", ["cu_seqlens", "seq_idx"])
def test_packing_on_another_device_is_named_before_its_values_are_read(name):
    """A meta tensor cannot be read: the one-device error must come first, naming the argument."""
    import tilegym_mamba2
    x, dt, B = torch.randn(1, 20, 2, 4), torch.rand(1, 20, 2), torch.randn(1, 20, 1, 4)
    packing = {"cu_seqlens": torch.tensor([0, 5, 20], device="meta"),
               "seq_idx": torch.zeros(1, 20, dtype=torch.int32, device="meta")}[name]
    with pytest.raises(ValueError, match=rf"^all tensors must be on one device, got x on cpu, {name} on meta"):
        tilegym_mamba2.mamba_chunk_scan_combined(x, dt, -torch.ones(2), B, B, 16, backend="pytorch",
                                                 **{name: packing})


def test_integer_likes_as_chunk_size_are_told_to_be_python_ints():
    import numpy as np
    x = torch.randn(1, 20, 2, 4)
    args = dict(x=x, a=-torch.ones(2), b=torch.randn(1, 20, 1, 8), c=torch.randn(1, 20, 1, 8), d=torch.ones(2),
                dt=torch.rand(1, 20, 2))
    for value, kind in ((np.int64(64), "numpy.int64"), (torch.tensor(64), "torch.Tensor")):
        with pytest.raises(ValueError, match=rf"chunk_size must be one of .* a Python int, got .* \(a {kind}: "
                                             rf"pass int\(chunk_size\)\)"):
            tilegym_mamba2.mamba2_chunk_forward(**args, chunk_size=value, backend="pytorch")


def test_cpu_tensors_through_tilegyms_dispatcher_under_an_unknown_backend_say_why_cutile_ran():
    tilegym = pytest.importorskip("tilegym")
    x = torch.randn(1, 20, 2, 4)
    with pytest.raises(ValueError, match="a backend it has no implementation of, a misspelt name included"):
        tilegym.ops.mamba2_chunk_forward(x, -torch.ones(2), torch.randn(1, 20, 1, 8), torch.randn(1, 20, 1, 8),
                                         torch.ones(2), torch.rand(1, 20, 2), None, 64, backend="bogus")
