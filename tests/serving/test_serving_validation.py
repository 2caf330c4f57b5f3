"""The serving ops' argument checks through the public functions (CPU): each bad argument raises
ValueError or TypeError naming it, and no state is written when a check fails."""
import pytest
import torch

from tilegym_mamba2.runtime import limits

import tilegym_mamba2
from tilegym_mamba2.serving.validation import (check_conv_args, check_conv_update_args,
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
        check_state_update_args(**kw, limits=limits.CUTILE)
    assert check_state_update_args(**kw, limits=limits.PYTORCH).x.dtype == torch.float64


def test_state_update_cutile_backend_needs_cuda_tensors():
    kw = state_update_kw()
    before = kw["state"].clone()
    with pytest.raises(ValueError, match="CUDA"):
        tilegym_mamba2.selective_state_update(**kw, backend="cutile")
    assert torch.equal(kw["state"], before)


def test_state_update_normal_form_is_views():
    kw = state_update_kw()
    kw["dt"] = torch.zeros(BATCH, HEADS, 1).expand(BATCH, HEADS, P)   # HF's expanded dt
    args = check_state_update_args(**kw, limits=limits.PYTORCH)
    assert args.state.data_ptr() == kw["state"].data_ptr() and args.dt.stride(-1) == 0 and args.has_heads
    flat = check_state_update_args(kw["state"][:, 0], kw["x"][:, 0], kw["dt"][:, 0], kw["A"][0], kw["B"][:, 0],
                                   kw["C"][:, 0], limits=limits.PYTORCH, state_batch_indices=kw["state_batch_indices"])
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
    assert check_conv_args(**kw, final_states_out=buffer, limits=limits.PYTORCH).final_states_out is None


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
        check_conv_update_args(**kw, limits=limits.PYTORCH)


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
    with pytest.raises(ValueError, match=r"^D must be \[heads, head_size\] \(state's\) = \(4, 8\) \(the form without heads only "
                                         r"goes with state \[slots, dim, state_size\]\), got \(4,\)$"):
        tilegym_mamba2.selective_state_update(**dict(kw, D=torch.zeros(HEADS)), backend="pytorch")


IN_PLACE_OPS = {
    "selective_state_update": (tilegym_mamba2.selective_state_update, state_update_kw, "state", "state_batch_indices"),
    "causal_conv1d_update": (tilegym_mamba2.causal_conv1d_update, conv_update_kw, "conv_state", "conv_state_indices"),
}


def _bad_buffer(kind, buffer):
    if kind == "inference":
        with torch.inference_mode():
            return buffer.clone()
    if kind == "requires_grad":
        return buffer.clone().requires_grad_()
    # an as_strided view whose rows overlap: no zero stride, yet elements share memory
    flat = buffer.flatten().clone()
    return flat.as_strided(buffer.shape, (buffer.stride(0) // 2, *buffer.stride()[1:]))


@pytest.mark.parametrize("op", sorted(IN_PLACE_OPS))
@pytest.mark.parametrize("kind, words", [("inference", "inference_mode"), ("requires_grad", "must not require grad"),
                                         ("overlap", "must not share memory")])
def test_in_place_buffers_are_checked_before_anything_is_written(op, kind, words):
    fn, make, buffer_name, _ = IN_PLACE_OPS[op]
    kw = make()
    kw[buffer_name] = buffer = _bad_buffer(kind, kw[buffer_name])
    before = buffer.detach().clone()
    with pytest.raises(ValueError, match=rf"^{buffer_name} .*{words}"):
        fn(**kw, backend="pytorch")
    assert torch.equal(buffer.detach(), before)


@pytest.mark.parametrize("op", sorted(IN_PLACE_OPS))
@pytest.mark.parametrize("indices, words", [([SLOTS, 0], "must be below"), ([1, 1], "must not repeat a slot")])
def test_host_indices_out_of_range_or_repeated_are_refused_before_a_write(op, indices, words):
    fn, make, buffer_name, index_name = IN_PLACE_OPS[op]
    kw = make()
    kw[index_name] = torch.tensor(indices, dtype=torch.int32)
    before = kw[buffer_name].clone()
    with pytest.raises(ValueError, match=rf"^{index_name} {words}"):
        fn(**kw, backend="pytorch")
    assert torch.equal(kw[buffer_name], before)


@pytest.mark.parametrize("op", sorted(IN_PLACE_OPS))
def test_padding_rows_among_the_indices_are_not_repeats(op):
    fn, make, buffer_name, index_name = IN_PLACE_OPS[op]
    kw = make()
    kw[index_name] = torch.tensor([-1, -1], dtype=torch.int32)
    before = kw[buffer_name].clone()
    out = fn(**kw, backend="pytorch")
    assert (out == 0).all() and torch.equal(kw[buffer_name], before)


def test_an_index_past_the_last_slot_is_a_padding_row_in_the_reference():
    from tilegym_mamba2.serving.validation import state_update_args
    from tilegym_mamba2.serving.reference import selective_state_update_reference
    kw = state_update_kw()
    kw["state_batch_indices"] = torch.tensor([SLOTS + 5, 0], dtype=torch.int32)   # as device indices may hold
    before = kw["state"].clone()
    out = selective_state_update_reference(state_update_args(**kw))
    assert (out[0] == 0).all() and (out[1] != 0).any()
    assert torch.equal(kw["state"][1:], before[1:])                      # only slot 0 (row 1's) is written


@pytest.mark.parametrize("change, words", [(dict(A=torch.ones(HEADS, P, N)), "^A must be negative"),
                                           (dict(dt=-torch.ones(BATCH, HEADS, P), dt_softplus=False, dt_bias=None),
                                            r"^dt \(plus dt_bias\) must be >= 0")])
def test_value_checks_on_request_name_the_argument(monkeypatch, change, words):
    kw = dict(state_update_kw(), **change)
    before = kw["state"].clone()
    tilegym_mamba2.selective_state_update(**kw, backend="pytorch")       # off by default: no read, no error
    kw["state"] = before.clone()
    monkeypatch.setenv("TILEGYM_MAMBA2_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match=words):
        tilegym_mamba2.selective_state_update(**kw, backend="pytorch")
    assert torch.equal(kw["state"], before)
