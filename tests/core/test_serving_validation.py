"""The serving ops' argument checks through the public functions (CPU): each bad argument raises
ValueError or TypeError naming it, and no state is written when a check fails."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.core.serving_validation import (check_conv_args, check_conv_update_args,
                                               check_state_update_args)

BATCH, HEADS, P, N, G, SLOTS = 2, 4, 8, 16, 2, 3
DIM, TOKENS, WIDTH = 6, 5, 4


def state_update_kw():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(state=r(SLOTS, HEADS, P, N), x=r(BATCH, HEADS, P), dt=r(BATCH, HEADS, P), A=-r(HEADS, P, N).abs(),
                B=r(BATCH, G, N), C=r(BATCH, G, N), D=r(HEADS, P), z=r(BATCH, HEADS, P), dt_bias=r(HEADS, P),
                dt_softplus=True, state_batch_indices=torch.tensor([2, 0], dtype=torch.int32))


def conv_kw():
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(BATCH, DIM, TOKENS, generator=g), weight=torch.randn(DIM, WIDTH, generator=g),
                bias=torch.randn(DIM, generator=g), activation="silu")


def conv_update_kw():
    g = torch.Generator().manual_seed(2)
    return dict(x=torch.randn(BATCH, DIM, generator=g), conv_state=torch.randn(SLOTS, DIM, WIDTH - 1, generator=g),
                weight=torch.randn(DIM, WIDTH, generator=g), bias=torch.randn(DIM, generator=g), activation="silu",
                conv_state_indices=torch.tensor([1, 2], dtype=torch.int32))


STATE_UPDATE_BAD = [
    ("state", torch.zeros(SLOTS, HEADS, P), ValueError),              # 3-D with a 3-D x is the form without heads
    ("state", [[0.0]], TypeError),
    ("state", torch.zeros(SLOTS, HEADS, P, N, dtype=torch.int32), TypeError),
    ("state", torch.zeros(1, 1, 1, 1).expand(SLOTS, HEADS, P, N), ValueError),  # written in place: no zero stride
    ("x", torch.zeros(BATCH, HEADS, P + 1), ValueError),
    ("x", torch.zeros(BATCH, HEADS, P, dtype=torch.int64), TypeError),
    ("dt", torch.zeros(BATCH, HEADS), ValueError),
    ("A", torch.zeros(HEADS, P), ValueError),
    ("B", torch.zeros(BATCH, 3, N), ValueError),                      # 4 heads, 3 groups
    ("B", torch.zeros(BATCH + 1, G, N), ValueError),
    ("C", torch.zeros(BATCH, G, N + 1), ValueError),
    ("D", torch.zeros(HEADS), ValueError),
    ("z", torch.zeros(BATCH, HEADS, P - 1), ValueError),
    ("dt_bias", torch.zeros(HEADS, P, 2), ValueError),
    ("dt_softplus", 1, TypeError),
    ("state_batch_indices", torch.tensor([0.0, 1.0]), TypeError),
    ("state_batch_indices", torch.tensor([0, 1, 2]), ValueError),
] + [(name, None, TypeError) for name in ("state", "x", "dt", "A", "B", "C")]  # required: None is refused


@pytest.mark.parametrize("name,value,error", STATE_UPDATE_BAD, ids=[f"{n}-{i}" for i, (n, _, _) in
                                                                     enumerate(STATE_UPDATE_BAD)])
def test_state_update_bad_argument_is_named_and_state_untouched(name, value, error):
    kw = state_update_kw()
    before = kw["state"].clone()
    kw[name] = value
    with pytest.raises(error, match=name):
        tilegym_mamba2.selective_state_update(**kw)
    if name != "state":
        assert torch.equal(kw["state"], before)


def test_state_update_batch_must_match_state_without_indices():
    kw = state_update_kw()
    kw["state_batch_indices"] = None
    with pytest.raises(ValueError, match="state_batch_indices"):
        tilegym_mamba2.selective_state_update(**kw)


def test_state_update_float64_only_for_pytorch():
    kw = state_update_kw()
    kw["x"] = kw["x"].double()
    with pytest.raises(TypeError, match="x"):
        check_state_update_args(**kw, backend="cutile")
    assert check_state_update_args(**kw, backend="pytorch").x.dtype == torch.float64


def test_state_update_cutile_backend_needs_cuda_tensors():
    kw = state_update_kw()
    before = kw["state"].clone()
    with pytest.raises(ValueError, match="CUDA"):
        tilegym_mamba2.selective_state_update(**kw, backend="cutile")
    assert torch.equal(kw["state"], before)


def test_state_update_normal_form_is_views():
    kw = state_update_kw()
    kw["dt"] = torch.zeros(BATCH, HEADS, 1).expand(BATCH, HEADS, P)   # HF's expanded dt
    args = check_state_update_args(**kw, backend="pytorch")
    assert args.state.data_ptr() == kw["state"].data_ptr() and args.dt.stride(-1) == 0 and args.has_heads
    flat = check_state_update_args(kw["state"][:, 0], kw["x"][:, 0], kw["dt"][:, 0], kw["A"][0], kw["B"][:, 0],
                                   kw["C"][:, 0], backend="pytorch", state_batch_indices=kw["state_batch_indices"])
    assert not flat.has_heads and flat.state.shape == (SLOTS, 1, P, N) and flat.B.shape == (BATCH, 1, N)


CONV_BAD = [
    ("x", torch.zeros(BATCH, DIM), ValueError),
    ("x", torch.zeros(BATCH, DIM, TOKENS, dtype=torch.int32), TypeError),
    ("weight", torch.zeros(DIM, 5), ValueError),
    ("weight", torch.zeros(DIM + 1, WIDTH), ValueError),
    ("bias", torch.zeros(DIM + 1), ValueError),
    ("activation", "relu", ValueError),
    ("seq_idx", torch.zeros(BATCH, TOKENS), TypeError),
    ("seq_idx", torch.zeros(BATCH, TOKENS + 1, dtype=torch.int32), ValueError),
    ("initial_states", torch.zeros(BATCH, DIM, WIDTH), ValueError),
    ("return_final_states", "yes", TypeError),
]


@pytest.mark.parametrize("name,value,error", CONV_BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CONV_BAD)])
def test_conv_bad_argument_is_named(name, value, error):
    kw = conv_kw()
    kw[name] = value
    with pytest.raises(error, match=name):
        tilegym_mamba2.causal_conv1d_fn(**kw)


def test_conv_seq_idx_excludes_initial_and_final_states():
    kw = conv_kw()
    seq_idx = torch.zeros(BATCH, TOKENS, dtype=torch.int32)
    with pytest.raises(ValueError, match="initial_states"):
        tilegym_mamba2.causal_conv1d_fn(**kw, seq_idx=seq_idx, initial_states=torch.zeros(BATCH, DIM, WIDTH - 1))
    with pytest.raises(ValueError, match="return_final_states"):
        tilegym_mamba2.causal_conv1d_fn(**kw, seq_idx=seq_idx, return_final_states=True)


def test_conv_bad_final_states_out_is_named_and_untouched():
    kw = conv_kw()
    buffer = torch.full((BATCH, DIM, WIDTH), 7.0)
    with pytest.raises(ValueError, match="final_states_out"):
        tilegym_mamba2.causal_conv1d_fn(**kw, return_final_states=True, final_states_out=buffer)
    assert torch.all(buffer == 7.0)
    # Without return_final_states it is ignored, as in causal_conv1d.
    assert check_conv_args(**kw, final_states_out=buffer, backend="pytorch").final_states_out is None


CONV_UPDATE_BAD = [
    ("x", torch.zeros(BATCH), ValueError),
    ("x", torch.zeros(BATCH, DIM, dtype=torch.int32), TypeError),
    ("conv_state", torch.zeros(SLOTS, DIM + 1, WIDTH - 1), ValueError),
    ("conv_state", torch.zeros(SLOTS, DIM, WIDTH - 2), ValueError),   # shorter than width - 1
    ("conv_state", torch.zeros(1, DIM, 1).expand(SLOTS, DIM, WIDTH - 1), ValueError),
    ("weight", torch.zeros(DIM, 1), ValueError),
    ("bias", torch.zeros(DIM, 2), ValueError),
    ("activation", "gelu", ValueError),
    ("cache_seqlens", torch.zeros(BATCH + 1, dtype=torch.int32), ValueError),
    ("cache_seqlens", torch.zeros(BATCH), TypeError),
    ("conv_state_indices", torch.zeros(BATCH, 1, dtype=torch.int32), ValueError),
    ("conv_state_indices", torch.zeros(BATCH, dtype=torch.float16), TypeError),
]


@pytest.mark.parametrize("name,value,error", CONV_UPDATE_BAD,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CONV_UPDATE_BAD)])
def test_conv_update_bad_argument_is_named_and_state_untouched(name, value, error):
    kw = conv_update_kw()
    before = kw["conv_state"].clone()
    kw[name] = value
    with pytest.raises(error, match=name):
        tilegym_mamba2.causal_conv1d_update(**kw)
    if name != "conv_state":
        assert torch.equal(kw["conv_state"], before)


def test_conv_update_batch_must_match_without_indices():
    kw = conv_update_kw()
    kw["conv_state_indices"] = None
    with pytest.raises(ValueError, match="conv_state_indices"):
        check_conv_update_args(**kw, backend="pytorch")


def test_conv_update_cutile_backend_needs_cuda_tensors():
    kw = conv_update_kw()
    before = kw["conv_state"].clone()
    with pytest.raises(ValueError, match="CUDA"):
        tilegym_mamba2.causal_conv1d_update(**kw, backend="cutile")
    assert torch.equal(kw["conv_state"], before)


def test_serving_ops_are_registered_with_tilegym():
    tilegym = pytest.importorskip("tilegym")
    from tilegym.backend import dispatcher
    for op in ("selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"):
        assert hasattr(tilegym.ops, op), op
        assert {"cutile", "pytorch"} <= set(dispatcher._REGISTRY[op]), op
    kw = conv_kw()
    out = tilegym.ops.causal_conv1d_fn(**kw, backend="pytorch")
    torch.testing.assert_close(out, tilegym_mamba2.causal_conv1d_fn(**kw))


def test_state_update_reports_the_shape_the_caller_gave():
    kw = state_update_kw()
    with pytest.raises(ValueError, match=r"^D must be \[heads, head_size\] = \(4, 8\) \(the form without heads only "
                                         r"goes with state \[slots, dim, state_size\]\), got \(4,\)$"):
        tilegym_mamba2.selective_state_update(**dict(kw, D=torch.zeros(HEADS)), backend="pytorch")
