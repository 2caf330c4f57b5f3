"""The serving ops' pytorch backend against plain loops over rows, channels and tokens (float64, CPU)."""
import math

import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.backends.pytorch import (causal_conv1d_fn_pytorch, causal_conv1d_update_pytorch,
                                              selective_state_update_pytorch)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def softplus(v):
    return v if v > 20.0 else math.log1p(math.exp(v))


def silu(v):
    return v / (1.0 + math.exp(-v))


# ---------------------------------------------------------------- selective_state_update

def state_update_loop(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices):
    """The definition, one scalar at a time; returns (new state, out)."""
    state = state.clone()
    batch, heads, head_size = x.shape
    state_size, groups = state.shape[-1], B.shape[1]
    out = torch.zeros(batch, heads, head_size, dtype=torch.float64)
    for i in range(batch):
        slot = i if indices is None else int(indices[i])
        if slot < 0:
            continue
        for h in range(heads):
            g = h // (heads // groups)
            for p in range(head_size):
                d = float(dt[i, h, p]) + (float(dt_bias[h, p]) if dt_bias is not None else 0.0)
                d = softplus(d) if dt_softplus else d
                acc = 0.0
                for n in range(state_size):
                    s = math.exp(float(A[h, p, n]) * d) * float(state[slot, h, p, n]) \
                        + d * float(x[i, h, p]) * float(B[i, g, n])
                    state[slot, h, p, n] = s
                    acc += s * float(C[i, g, n])
                if D is not None:
                    acc += float(D[h, p]) * float(x[i, h, p])
                if z is not None:
                    acc *= silu(float(z[i, h, p]))
                out[i, h, p] = acc
    return state, out


def state_update_inputs(batch=3, heads=4, head_size=3, state_size=5, groups=2, slots=None, seed=0,
                        tied=False):
    g = gen(seed)
    slots = batch if slots is None else slots

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if tied:  # HF's Mamba-2 call: dt, A, D, dt_bias per head, expanded with stride 0
        dt = r(batch, heads)[:, :, None].expand(batch, heads, head_size)
        A = (-torch.rand(heads, generator=g, dtype=torch.float64))[:, None, None].expand(heads, head_size, state_size)
        D = r(heads)[:, None].expand(heads, head_size)
        dt_bias = r(heads)[:, None].expand(heads, head_size)
    else:
        dt, A = r(batch, heads, head_size), -torch.rand(heads, head_size, state_size, generator=g, dtype=torch.float64)
        D, dt_bias = r(heads, head_size), r(heads, head_size)
    return dict(state=r(slots, heads, head_size, state_size), x=r(batch, heads, head_size), dt=dt, A=A,
                B=r(batch, groups, state_size), C=r(batch, groups, state_size), D=D, z=r(batch, heads, head_size),
                dt_bias=dt_bias, dt_softplus=True)


@pytest.mark.parametrize("options", ["all", "none", "no_softplus", "tied", "z_only"])
def test_state_update_matches_loop(options):
    kw = state_update_inputs(tied=options == "tied")
    if options == "none":
        kw.update(D=None, z=None, dt_bias=None, dt_softplus=False)
        kw["dt"] = kw["dt"].abs()
    elif options == "no_softplus":
        kw.update(dt_softplus=False)
        kw["dt"] = kw["dt"].abs()
    elif options == "z_only":
        kw.update(D=None, dt_bias=None)
    expected_state, expected_out = state_update_loop(**kw, indices=None)
    state = kw["state"]
    out = selective_state_update_pytorch(**kw)
    assert out.dtype == torch.float64 and out.shape == kw["x"].shape
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, expected_state, rtol=1e-12, atol=1e-12)


def test_state_update_softplus_passes_large_dt_through():
    kw = state_update_inputs(batch=1, heads=2, head_size=2, state_size=3, groups=1)
    kw["dt"] = torch.full_like(kw["dt"], 30.0)
    kw["dt_bias"] = None
    kw["A"] = torch.full_like(kw["A"], -0.01)
    expected_state, expected_out = state_update_loop(**kw, indices=None)
    selective_state_update_pytorch(**kw)
    torch.testing.assert_close(kw["state"], expected_state, rtol=1e-12, atol=1e-12)


def test_state_update_continuous_batching_and_padding_rows():
    kw = state_update_inputs(batch=4, slots=6, seed=3)
    indices = torch.tensor([5, -1, 0, 2])
    before = kw["state"].clone()
    expected_state, expected_out = state_update_loop(**kw, indices=indices)
    out = selective_state_update_pytorch(**kw, state_batch_indices=indices)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kw["state"], expected_state, rtol=1e-12, atol=1e-12)
    assert torch.all(out[1] == 0), "a padding row's output is zeros"
    for untouched in (1, 3, 4):
        assert torch.equal(kw["state"][untouched], before[untouched]), f"state row {untouched} was written"
    assert not torch.equal(kw["state"][5], before[5])


def test_state_update_all_rows_padding_writes_nothing():
    kw = state_update_inputs(batch=2, slots=3, seed=4)
    before = kw["state"].clone()
    out = selective_state_update_pytorch(**kw, state_batch_indices=torch.tensor([-1, -3], dtype=torch.int32))
    assert torch.equal(kw["state"], before) and torch.all(out == 0)


def test_state_update_form_without_heads():
    """mamba_ssm's 3-D form (Mamba-1): state [batch, dim, state_size], x [batch, dim], B [batch, state_size]."""
    kw = state_update_inputs(heads=1, groups=1, head_size=6, seed=5)
    flat = dict(state=kw["state"][:, 0].clone(), x=kw["x"][:, 0], dt=kw["dt"][:, 0], A=kw["A"][0], B=kw["B"][:, 0],
                C=kw["C"][:, 0], D=kw["D"][0], z=kw["z"][:, 0], dt_bias=kw["dt_bias"][0], dt_softplus=True)
    out = selective_state_update_pytorch(**flat)
    expected_state, expected_out = state_update_loop(**kw, indices=None)
    assert out.shape == flat["x"].shape
    torch.testing.assert_close(out, expected_out[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(flat["state"], expected_state[:, 0], rtol=1e-12, atol=1e-12)


def test_state_update_low_precision_keeps_dtypes():
    kw = state_update_inputs(seed=6)
    kw["x"], kw["z"] = kw["x"].bfloat16(), kw["z"].bfloat16()
    kw["B"], kw["C"] = kw["B"].bfloat16(), kw["C"].bfloat16()
    kw["state"] = kw["state"].float()
    ref_state = kw["state"].double()
    _, expected_out = state_update_loop(**dict(kw, state=ref_state), indices=None)
    out = selective_state_update_pytorch(**kw)
    assert out.dtype == torch.bfloat16 and kw["state"].dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_out, rtol=2e-2, atol=2e-2)


def test_public_function_defaults_to_pytorch_on_cpu():
    kw = state_update_inputs(seed=7)
    expected_state, expected_out = state_update_loop(**kw, indices=None)
    out = tilegym_mamba2.selective_state_update(**kw)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kw["state"], expected_state, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- causal_conv1d_fn

def conv_loop(x, weight, bias, seq_idx, initial_states, silu_act):
    batch, dim, tokens = x.shape
    width = weight.shape[1]
    out = torch.zeros(batch, dim, tokens, dtype=torch.float64)
    for b in range(batch):
        for c in range(dim):
            for t in range(tokens):
                if seq_idx is not None and int(seq_idx[b, t]) < 0:
                    continue
                acc = float(bias[c]) if bias is not None else 0.0
                for w in range(width):
                    s = t - (width - 1) + w
                    if s >= 0:
                        if seq_idx is not None and int(seq_idx[b, s]) != int(seq_idx[b, t]):
                            continue
                        v = float(x[b, c, s])
                    else:
                        v = float(initial_states[b, c, width - 1 + s]) if initial_states is not None else 0.0
                    acc += float(weight[c, w]) * v
                out[b, c, t] = silu(acc) if silu_act else acc
    return out


def conv_inputs(batch=2, dim=5, tokens=9, width=4, seed=0, channel_last=False):
    g = gen(seed)
    x = torch.randn(batch, dim, tokens, generator=g, dtype=torch.float64)
    if channel_last:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return dict(x=x, weight=torch.randn(dim, width, generator=g, dtype=torch.float64),
                bias=torch.randn(dim, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu", "swish"])
def test_conv_matches_loop(width, activation):
    kw = conv_inputs(width=width, seed=width, channel_last=activation == "silu")
    out = causal_conv1d_fn_pytorch(**kw, activation=activation)
    expected = conv_loop(kw["x"], kw["weight"], kw["bias"], None, None, activation is not None)
    assert out.shape == kw["x"].shape and out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_conv_initial_and_final_states(tokens):
    kw = conv_inputs(tokens=tokens, seed=10 + tokens)
    init = torch.randn(2, 5, 3, generator=gen(tokens), dtype=torch.float64)
    out, final = causal_conv1d_fn_pytorch(**kw, initial_states=init, return_final_states=True)
    torch.testing.assert_close(out, conv_loop(kw["x"], kw["weight"], kw["bias"], None, init, False),
                               rtol=1e-12, atol=1e-12)
    expected_final = torch.cat([init, kw["x"]], dim=-1)[..., -3:]
    assert torch.equal(final, expected_final)
    buffer = torch.full((2, 5, 3), float("nan"), dtype=torch.float64)
    out2, final2 = causal_conv1d_fn_pytorch(**kw, initial_states=init, return_final_states=True,
                                            final_states_out=buffer)
    assert final2 is buffer and torch.equal(buffer, expected_final) and torch.equal(out2, out)


def test_conv_final_states_without_initial_states_pad_with_zeros():
    kw = conv_inputs(tokens=2, width=4, seed=20)
    _, final = causal_conv1d_fn_pytorch(**kw, return_final_states=True)
    assert torch.all(final[..., 0] == 0) and torch.equal(final[..., 1:], kw["x"])


def test_conv_seq_idx_resets_at_boundaries_and_zeroes_padding():
    kw = conv_inputs(batch=2, tokens=10, seed=21)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, -1, -1]], dtype=torch.int32)
    out = causal_conv1d_fn_pytorch(**kw, seq_idx=seq_idx, activation="silu")
    expected = conv_loop(kw["x"], kw["weight"], kw["bias"], seq_idx, None, True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.all(out[1, :, 8:] == 0)
    # A sequence's first token sees only itself: bias + last tap * x.
    first = kw["bias"] + kw["weight"][:, -1] * kw["x"][0, :, 3]
    torch.testing.assert_close(out[0, :, 3], torch.nn.functional.silu(first), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- causal_conv1d_update

def conv_update_loop(x, conv_state, weight, bias, silu_act, cache_seqlens, indices):
    """Token by token, as the definition reads: (new conv_state, out)."""
    conv_state = conv_state.clone()
    batch, dim, tokens = x.shape
    width, state_len = weight.shape[1], conv_state.shape[2]
    out = torch.zeros(batch, dim, tokens, dtype=torch.float64)
    for b in range(batch):
        slot = b if indices is None else int(indices[b])
        if slot < 0:
            continue
        for c in range(dim):
            row = [float(v) for v in conv_state[slot, c]]
            if cache_seqlens is None:
                seq = row + [float(v) for v in x[b, c]]
                for t in range(tokens):
                    window = seq[state_len + t - (width - 1): state_len + t + 1]
                    acc = (float(bias[c]) if bias is not None else 0.0) + sum(
                        float(weight[c, w]) * window[w] for w in range(width))
                    out[b, c, t] = silu(acc) if silu_act else acc
                conv_state[slot, c] = torch.tensor(seq[-state_len:], dtype=conv_state.dtype)
            else:
                pos = int(cache_seqlens[b]) % state_len
                history = [row[(pos - (width - 1) + k) % state_len] for k in range(width - 1)]
                for t in range(tokens):
                    row[(pos + t) % state_len] = float(x[b, c, t])
                seq = history + [float(v) for v in x[b, c]]
                for t in range(tokens):
                    acc = (float(bias[c]) if bias is not None else 0.0) + sum(
                        float(weight[c, w]) * seq[t + w] for w in range(width))
                    out[b, c, t] = silu(acc) if silu_act else acc
                conv_state[slot, c] = torch.tensor(row, dtype=conv_state.dtype)
    return conv_state, out


def conv_update_inputs(batch=3, dim=4, tokens=1, width=4, state_len=None, slots=None, seed=0):
    g = gen(seed)
    state_len = width - 1 if state_len is None else state_len
    slots = batch if slots is None else slots
    return dict(x=torch.randn(batch, dim, tokens, generator=g, dtype=torch.float64),
                conv_state=torch.randn(slots, dim, state_len, generator=g, dtype=torch.float64),
                weight=torch.randn(dim, width, generator=g, dtype=torch.float64),
                bias=torch.randn(dim, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("width,state_len,tokens", [(4, 3, 1), (2, 1, 1), (3, 5, 1), (4, 3, 3), (4, 6, 2),
                                                    (3, 2, 5)])
@pytest.mark.parametrize("circular", [False, True])
def test_conv_update_matches_loop(width, state_len, tokens, circular):
    kw = conv_update_inputs(width=width, state_len=state_len, tokens=tokens, seed=width * 10 + state_len)
    cache_seqlens = torch.tensor([0, 4, 11], dtype=torch.int32) if circular else None
    expected_state, expected_out = conv_update_loop(kw["x"], kw["conv_state"], kw["weight"], kw["bias"], True,
                                                    cache_seqlens, None)
    out = causal_conv1d_update_pytorch(**kw, activation="silu", cache_seqlens=cache_seqlens)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kw["conv_state"], expected_state, rtol=0, atol=0)


def test_conv_update_two_dimensional_x_and_indices():
    kw = conv_update_inputs(batch=3, slots=5, seed=40)
    kw["x"] = kw["x"][..., 0]
    indices = torch.tensor([4, -1, 1], dtype=torch.int32)
    before = kw["conv_state"].clone()
    expected_state, expected_out = conv_update_loop(kw["x"][..., None], before, kw["weight"], kw["bias"], False,
                                                    None, indices)
    out = causal_conv1d_update_pytorch(**kw, conv_state_indices=indices)
    assert out.shape == kw["x"].shape
    torch.testing.assert_close(out, expected_out[..., 0], rtol=1e-12, atol=1e-12)
    assert torch.equal(kw["conv_state"], expected_state)
    assert torch.all(out[1] == 0)
    for untouched in (0, 2, 3):
        assert torch.equal(kw["conv_state"][untouched], before[untouched])


def test_conv_update_continues_the_full_convolution():
    """Prefill with causal_conv1d_fn (final states), then decode token by token: the same outputs
    as convolving the whole sequence at once."""
    kw = conv_inputs(batch=2, dim=6, tokens=12, width=4, seed=50)
    full = causal_conv1d_fn_pytorch(**kw, activation="silu")
    prefix = dict(kw, x=kw["x"][..., :8])
    _, state = causal_conv1d_fn_pytorch(**prefix, activation="silu", return_final_states=True)
    state = state.clone()
    for t in range(8, 12):
        out = causal_conv1d_update_pytorch(kw["x"][..., t], state, kw["weight"], kw["bias"], "silu")
        torch.testing.assert_close(out, full[..., t], rtol=1e-12, atol=1e-12)
