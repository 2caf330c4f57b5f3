"""Random bad arguments to every public op (fixed seeds; the pytorch backend on CPU, the cutile one
on a GPU): each call either runs or raises ValueError / TypeError, never another exception (an
AttributeError deep inside, a shape error from torch, a compiler's), and a value no contract takes
(another shape, an integer tensor for a float one) is refused, never run. The named cases live in
test_validation.py and test_serving_validation.py; this sweeps the combinations they do not list."""
import random

import pytest
import torch

import tilegym_mamba2 as tm

B, T, H, P, N, G = 2, 70, 4, 16, 16, 2  # sizes the cutile kernels take


def scan_kw():
    return dict(x=torch.randn(B, T, H, P), dt=torch.rand(B, T, H), A=-torch.rand(H), B=torch.randn(B, T, G, N),
                C=torch.randn(B, T, G, N), chunk_size=32, D=torch.randn(H), z=torch.randn(B, T, H, P),
                dt_bias=torch.randn(H), initial_states=torch.randn(B, H, P, N),
                seq_idx=torch.zeros(B, T, dtype=torch.int32))


def forward_kw():
    return dict(x=torch.randn(B, T, H, P), a=-torch.rand(H), b=torch.randn(B, T, 1, N), c=torch.randn(B, T, 1, N),
                d=torch.randn(H), dt=torch.rand(B, T, H), init_state=torch.randn(B, H, P, N), chunk_size=32)


def backward_kw():
    kw = forward_kw()
    return dict(kw, dout=torch.randn(B, T, H, P), dfinal_state=torch.randn(B, H, P, N))


def state_update_kw():
    return dict(state=torch.randn(3, H, P, N), x=torch.randn(3, H, P), dt=torch.rand(3, H, P),
                A=-torch.rand(H, P, N), B=torch.randn(3, 1, N), C=torch.randn(3, 1, N), D=torch.randn(H, P),
                z=torch.randn(3, H, P), dt_bias=torch.randn(H, P))


def conv_kw():
    return dict(x=torch.randn(B, 12, 20), weight=torch.randn(12, 4), bias=torch.randn(12))


def conv_update_kw():
    return dict(x=torch.randn(B, 12), conv_state=torch.randn(B, 12, 3), weight=torch.randn(12, 4),
                bias=torch.randn(12))


def split_kw():
    dim = H * P
    return dict(zxbcdt=torch.randn(B, 40, 2 * dim + 2 * N + H), conv1d_weight=torch.randn(dim + 2 * N, 4),
                conv1d_bias=torch.randn(dim + 2 * N), dt_bias=torch.randn(H), A=-torch.rand(H), D=torch.randn(H),
                chunk_size=32, headdim=P, ngroups=1)


OPS = {  # name -> (arguments, call(arguments, backend))
    "mamba_chunk_scan_combined": (scan_kw, lambda kw, be: tm.mamba_chunk_scan_combined(**kw, dt_softplus=True,
                                                                                       backend=be)),
    "mamba2_chunk_forward": (forward_kw, lambda kw, be: tm.mamba2_chunk_forward(**kw, backend=be)),
    "mamba2_chunk_backward": (backward_kw, lambda kw, be: tm.mamba2_chunk_backward(**kw, backend=be)),
    "selective_state_update": (state_update_kw, lambda kw, be: tm.selective_state_update(**kw, dt_softplus=True,
                                                                                         backend=be)),
    "causal_conv1d_fn": (conv_kw, lambda kw, be: tm.causal_conv1d_fn(**kw, activation="silu", backend=be)),
    "causal_conv1d_update": (conv_update_kw, lambda kw, be: tm.causal_conv1d_update(**kw, activation="silu",
                                                                                   backend=be)),
    "mamba_split_conv1d_scan_combined": (split_kw, lambda kw, be: tm.mamba_split_conv1d_scan_combined(
        **kw, backend=be)),
}


def bad_value(value, rng):
    """One wrong variant of an argument: another dtype, a dimension short or extra, flattened,
    transposed, empty, None, the same values in another memory layout, or for a non-tensor
    another kind of value."""
    if not isinstance(value, torch.Tensor):
        return rng.choice([0, -1, 3, 7, None, "x", 1.5])
    kind = rng.randrange(9)
    if kind == 7 and value.ndim > 1:
        return value[:, :0]
    if kind == 8 and value.ndim > 1:  # the same values, not contiguous: must run or be refused by name
        return value.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == 0:
        return value.to(torch.int64) if value.is_floating_point() else value.float()
    if kind == 1:
        return value[..., :max(1, value.shape[-1] - 1)]
    if kind == 2:
        return value.unsqueeze(0)
    if kind == 3:
        return value.reshape(-1)
    if kind == 4:
        return value.to(torch.float16) if value.is_floating_point() else value
    if kind == 5 and value.ndim > 1:
        return value.transpose(0, -1)
    return None


def surely_bad(value, bad) -> bool:
    """Whether no contract takes ``bad`` where ``value`` was: another number of dimensions, no
    elements, or a float tensor turned integer (or the reverse). Other variants may be right and may
    run: a shorter last dimension (a convolution's width), a transpose (batch and length swapped),
    fp16, a non-contiguous copy, None for an optional argument."""
    if not isinstance(value, torch.Tensor) or not isinstance(bad, torch.Tensor):
        return False
    return (bad.ndim != value.ndim or (bad.numel() == 0 < value.numel())
            or bad.is_floating_point() != value.is_floating_point())


def sweep(op, backend, device, trials):
    make, call = OPS[op]

    def arguments():
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in make().items()}
    call(arguments(), backend)  # the unchanged arguments run
    rng = random.Random(op)
    for _ in range(trials):
        kw = arguments()
        name = rng.choice(list(kw))
        original, kw[name] = kw[name], bad_value(kw[name], rng)
        try:
            call(kw, backend)
        except (ValueError, TypeError):
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{op} ({backend}) with a bad {name} ({kw[name]!r:.80}) raised {type(e).__name__}: {e}")
        if surely_bad(original, kw[name]):
            pytest.fail(f"{op} ({backend}) ran with a bad {name}: {tuple(kw[name].shape)} {kw[name].dtype} where "
                        f"{tuple(original.shape)} {original.dtype} was expected, instead of refusing it")


@pytest.mark.parametrize("op", list(OPS))
def test_bad_arguments_raise_value_or_type_errors(op):
    sweep(op, "pytorch", "cpu", 300)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_bad_arguments_to_the_cutile_kernels_raise_value_or_type_errors(op):
    """The same on CUDA tensors and our kernels: a bad input that passes the checks must not reach
    a compiler or a launch that fails."""
    sweep(op, "cutile", "cuda", 30)


def test_the_sweep_fails_on_an_op_that_takes_anything(monkeypatch):
    """An op that runs whatever it is given is caught: the sweep fails, naming the argument."""
    monkeypatch.setitem(OPS, "takes_anything", (forward_kw, lambda kw, be: None))
    with pytest.raises(pytest.fail.Exception, match="takes_anything .pytorch. ran with a bad"):
        sweep("takes_anything", "pytorch", "cpu", 300)
