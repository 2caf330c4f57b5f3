"""float64 on the "pytorch" backends (CPU): both ops take it, compute in it and return it, so
torch.autograd.gradcheck runs through them; the cutile backend refuses it, naming the argument."""
import pytest
import torch

from tilegym_mamba2.runtime import limits
import torch.nn.functional as F

import tilegym_mamba2
from tilegym_mamba2.backends.pytorch import mamba2_chunk_forward_pytorch, mamba_chunk_scan_combined_pytorch
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.ssd.reference.forward import token_recurrence
from tilegym_mamba2.core.validation import check_forward_args, check_scan_combined_args
from tilegym_mamba2.testing import relative_error as rel_err

F64 = torch.float64


def forward_args(batch=2, tokens=37, groups=2, heads=4, head_size=8, state=16, chunk=16, seed=0,
                 requires_grad=False):
    """mamba2_chunk_forward's arguments, every tensor float64 (a ragged last chunk by default)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=F64)

    args = dict(
        x=randn(batch, tokens, heads, head_size),
        a=-(0.5 + 2 * torch.rand(heads, generator=gen, dtype=F64)),
        b=randn(batch, tokens, groups, state),
        c=randn(batch, tokens, groups, state),
        d=randn(heads),
        dt=F.softplus(randn(batch, tokens, heads) - 1),
        init_state=randn(batch, heads, head_size, state),
    )
    for t in args.values():
        t.requires_grad_(requires_grad)
    return args | {"chunk_size": chunk}


def layer_args(batch=1, tokens=29, groups=1, heads=2, head_size=4, state=8, seed=1, requires_grad=False):
    """mamba_chunk_scan_combined's tensors, float64, with every option: D per channel, z, dt_bias."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=F64)

    args = dict(
        x=randn(batch, tokens, heads, head_size),
        dt=randn(batch, tokens, heads) - 1,        # raw: goes through dt_bias and softplus
        A=-(0.5 + 2 * torch.rand(heads, generator=gen, dtype=F64)),
        B=randn(batch, tokens, groups, state),
        C=randn(batch, tokens, groups, state),
        D=randn(heads, head_size),
        z=randn(batch, tokens, heads, head_size),
        dt_bias=randn(heads) * 0.5,
    )
    for t in args.values():
        t.requires_grad_(requires_grad)
    return args


# ---------------------------------------------------------------- float64 forward

@pytest.mark.parametrize("init", [True, False])
def test_forward_op_float64_matches_token_recurrence(init):
    args = forward_args()
    if not init:
        args["init_state"] = None
    for out, final in (mamba2_chunk_forward_pytorch(**args),
                       tilegym_mamba2.mamba2_chunk_forward(**args, backend="pytorch")):
        assert out.dtype == final.dtype == F64
        ref_out, ref_final = token_recurrence(**{k: v for k, v in args.items() if k != "chunk_size"})
        assert rel_err(out, ref_out) < 1e-10
        assert rel_err(final, ref_final) < 1e-10


def test_forward_op_float64_through_tilegym():
    tilegym = pytest.importorskip("tilegym")
    args = forward_args(batch=1, tokens=20, seed=3)
    out, final = tilegym.ops.mamba2_chunk_forward(**args, backend="pytorch")
    ref_out, ref_final = token_recurrence(**{k: v for k, v in args.items() if k != "chunk_size"})
    assert out.dtype == final.dtype == F64
    assert rel_err(out, ref_out) < 1e-10 and rel_err(final, ref_final) < 1e-10


def test_float64_is_more_exact_than_float32():
    """The float64 path really computes in float64: float32 inputs of the same values, which
    compute in float32, land ~1e-7 away from the definition, float64 ~1e-15."""
    args = forward_args(tokens=64, seed=4)
    ref_out, _ = token_recurrence(**{k: v for k, v in args.items() if k != "chunk_size"})
    out64, _ = mamba2_chunk_forward_pytorch(**args)
    out32, final32 = mamba2_chunk_forward_pytorch(
        **{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert out32.dtype == final32.dtype == torch.float32
    assert rel_err(out64, ref_out) < 1e-13 < 1e-9 < rel_err(out32, ref_out)


@pytest.mark.parametrize("packing", ["cu_seqlens", "seq_idx", "none"])
def test_layer_op_float64_matches_token_recurrence(packing):
    batch = 2 if packing == "seq_idx" else 1
    args = layer_args(batch=batch, tokens=40, heads=4, groups=2, head_size=8, state=16, seed=5)
    options = dict(dt_softplus=True, dt_limit=(0.01, 3.0))
    if packing == "cu_seqlens":
        options["cu_seqlens"] = torch.tensor([0, 5, 23, 40], dtype=torch.int32)
        options["initial_states"] = torch.randn(3, 4, 8, 16, dtype=F64)   # one per sequence
    elif packing == "seq_idx":
        options["seq_idx"] = torch.tensor([[0] * 17 + [1] * 23, [0] * 3 + [1] * 30 + [2] * 7], dtype=torch.int32)
        options["initial_states"] = torch.randn(batch, 4, 8, 16, dtype=F64)
    varlen = packing == "cu_seqlens"
    result = tilegym_mamba2.mamba_chunk_scan_combined(
        **args, chunk_size=16, **options, return_final_states=True, return_varlen_states=varlen,
        backend="pytorch")
    ref_out, ref_final, ref_varlen = layer_token_recurrence(**args, **options)
    out, final = result[:2]
    assert out.dtype == final.dtype == F64
    assert rel_err(out, ref_out) < 1e-10 and rel_err(final, ref_final) < 1e-10
    if varlen:
        assert result[2].dtype == F64 and rel_err(result[2], ref_varlen) < 1e-10


# ---------------------------------------------------------------- cutile refuses float64

def test_cutile_refuses_float64_naming_x():
    # The dtype is checked before the device, so this runs on a CPU.
    with pytest.raises(TypeError, match=r"^x must be bfloat16, float16 or float32 for the cutile backend, "
                                        r"got torch\.float64"):
        check_forward_args(**forward_args(), limits=limits.CUTILE)
    with pytest.raises(TypeError, match=r"^x must be .* for the cutile backend, got torch\.float64"):
        check_scan_combined_args(**layer_args(), chunk_size=16, limits=limits.CUTILE)


def test_cutile_ops_refuse_float64_naming_x():
    pytest.importorskip("cuda.tile")
    with pytest.raises(TypeError, match=r"^x must be .* for the cutile backend, got torch\.float64"):
        tilegym_mamba2.mamba2_chunk_forward(**forward_args(), backend="cutile")
    with pytest.raises(TypeError, match=r"^x must be .* for the cutile backend, got torch\.float64"):
        tilegym_mamba2.mamba_chunk_scan_combined(**layer_args(), chunk_size=16, backend="cutile")


def test_pytorch_still_refuses_mixed_float64():
    args = forward_args()
    args["b"] = args["b"].float()
    with pytest.raises(TypeError, match=r"^b must have x's dtype torch\.float64"):
        mamba2_chunk_forward_pytorch(**args)


# ---------------------------------------------------------------- gradcheck of the pytorch backends

NAMES = ("x", "a", "b", "c", "d", "dt", "init_state")


@pytest.mark.parametrize("tokens,chunk", [(7, 16), (21, 16)])   # one ragged chunk; two chunks
def test_gradcheck_forward_op(tokens, chunk):
    args = forward_args(batch=1, tokens=tokens, groups=1, heads=2, head_size=3, state=2, chunk=chunk,
                        seed=6, requires_grad=True)

    def op(*tensors):
        return mamba2_chunk_forward_pytorch(*tensors, chunk_size=chunk)

    assert torch.autograd.gradcheck(op, tuple(args[k] for k in NAMES))


def test_gradcheck_forward_op_groups():
    # 2 heads read 1 group: B's and C's gradients sum over the heads of a group.
    args = forward_args(batch=2, tokens=18, groups=1, heads=2, head_size=2, state=3, chunk=16,
                        seed=7, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: mamba2_chunk_forward_pytorch(*t, chunk_size=16),
                                    tuple(args[k] for k in NAMES))


LAYER_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")


@pytest.mark.parametrize("packing", ["cu_seqlens", "seq_idx"])
def test_gradcheck_layer_op(packing):
    """Every option: D per channel, z, dt_bias with softplus, packed sequences, initial states."""
    if packing == "cu_seqlens":
        args = layer_args(batch=1, tokens=21, requires_grad=True)
        options = dict(cu_seqlens=torch.tensor([0, 4, 18, 21], dtype=torch.int32), return_varlen_states=True)
        init = torch.randn(3, 2, 4, 8, dtype=F64, requires_grad=True)         # one per sequence
    else:
        args = layer_args(batch=2, tokens=19, requires_grad=True)
        options = dict(seq_idx=torch.tensor([[0] * 6 + [1] * 13, [0] * 17 + [1] * 2], dtype=torch.int32))
        init = torch.randn(2, 2, 4, 8, dtype=F64, requires_grad=True)         # each row's first sequence

    def op(*tensors):
        named = dict(zip(LAYER_NAMES + ("initial_states",), tensors))
        return mamba_chunk_scan_combined_pytorch(**named, chunk_size=16, dt_softplus=True,
                                                 return_final_states=True, **options)

    assert torch.autograd.gradcheck(op, tuple(args[k] for k in LAYER_NAMES) + (init,))


def test_gradcheck_would_catch_a_wrong_gradient():
    """The check above can fail: a function whose backward is off is refused."""

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return 1.01 * grad

    args = forward_args(batch=1, tokens=5, groups=1, heads=1, head_size=2, state=2, seed=8, requires_grad=True)

    def op(x, *rest):
        return mamba2_chunk_forward_pytorch(Wrong.apply(x), *rest, chunk_size=16)

    assert not torch.autograd.gradcheck(op, tuple(args[k] for k in NAMES), raise_exception=False)
