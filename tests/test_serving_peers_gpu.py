"""The serving ops against the originals on the same inputs: mamba_ssm's selective_state_update and
causal_conv1d's causal_conv1d_fn / causal_conv1d_update (each skipped when its package cannot be
imported, and without CUDA, tests/conftest.py). Same arguments, same results: the functions are
drop-ins for what HF's Mamba2Mixer and serving engines call."""
import inspect

import pytest
import torch

import tilegym_mamba2
from gpu_checks import fresh_seed, rel_err

try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as mamba_ssm_update
    _MAMBA_ERROR = None
except Exception as error:  # ImportError, or a CUDA extension that fails to load
    mamba_ssm_update, _MAMBA_ERROR = None, f"{type(error).__name__}: {error}"
try:
    from causal_conv1d import causal_conv1d_fn as peer_conv, causal_conv1d_update as peer_conv_update
    _CONV_ERROR = None
except Exception as error:
    peer_conv = peer_conv_update = None
    _CONV_ERROR = f"{type(error).__name__}: {error}"

pytestmark = pytest.mark.gpu
needs_mamba_ssm = pytest.mark.skipif(mamba_ssm_update is None, reason=f"mamba_ssm cannot be imported ({_MAMBA_ERROR})")
needs_causal_conv1d = pytest.mark.skipif(peer_conv is None, reason=f"causal_conv1d cannot be imported ({_CONV_ERROR})")


def generator():
    seed = fresh_seed()
    return seed, torch.Generator(device="cuda").manual_seed(seed)


@needs_mamba_ssm
@pytest.mark.parametrize("batch", [1, 16, 256])
@pytest.mark.parametrize("with_indices", [False, True])
def test_state_update_like_mamba_ssm(batch, with_indices):
    """Mamba2-2.7B-like decode step in HF's form (dt, A, D, dt_bias expanded per head, softplus)."""
    if with_indices and "state_batch_indices" not in inspect.signature(mamba_ssm_update).parameters:
        pytest.skip("this mamba_ssm has no state_batch_indices")
    seed, g = generator()
    heads, head_size, state_size, groups = 80, 64, 128, 1
    slots = batch + 3 if with_indices else batch

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    state = r(slots, heads, head_size, state_size, dtype=torch.float32)
    x, z = r(batch, heads, head_size), r(batch, heads, head_size)
    dt = r(batch, heads)[:, :, None].expand(-1, -1, head_size)
    A = -torch.exp(r(heads, dtype=torch.float32))[:, None, None].expand(-1, head_size, state_size)
    B, C = r(batch, groups, state_size), r(batch, groups, state_size)
    D = r(heads, dtype=torch.float32)[:, None].expand(-1, head_size)
    dt_bias = r(heads, dtype=torch.float32)[:, None].expand(-1, head_size)
    kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    if with_indices:
        # No padding rows (-1) here: older releases read out of bounds with them. Padding is
        # checked against the reference in tests/serving/test_serving_gpu.py.
        kw["state_batch_indices"] = torch.randperm(slots, generator=g, device="cuda")[:batch].to(torch.int32)
    theirs_state = state.clone()
    theirs = mamba_ssm_update(theirs_state, x, dt, A, B, C, **kw)
    ours = tilegym_mamba2.selective_state_update(state, x, dt, A, B, C, **kw)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert rel_err(ours, theirs) < 1e-2, f"out, seed={seed}"
    assert rel_err(state, theirs_state) < 1e-5, f"state, seed={seed}"


@needs_causal_conv1d
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_conv_like_causal_conv1d(with_seq_idx):
    """HF's prefill call: channel-last x over Mamba2-2.7B's 5376 xBC channels, width 4, silu."""
    seed, g = generator()
    batch, dim, tokens = 2, 5376, 333
    x = torch.randn(batch, tokens, dim, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    weight = torch.randn(dim, 4, generator=g, device="cuda").to(torch.bfloat16)
    bias = torch.randn(dim, generator=g, device="cuda").to(torch.bfloat16)
    seq_idx = None
    if with_seq_idx:
        seq_idx = torch.cat([torch.zeros(batch, 100), torch.ones(batch, tokens - 100)], 1).to(
            device="cuda", dtype=torch.int32)
    theirs = peer_conv(x, weight, bias, seq_idx=seq_idx, activation="silu")
    ours = tilegym_mamba2.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    assert rel_err(ours, theirs) < 1e-2, f"seed={seed}"


@needs_causal_conv1d
def test_conv_final_states_like_causal_conv1d():
    seed, g = generator()
    batch, dim, tokens = 2, 512, 70
    x = torch.randn(batch, tokens, dim, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    weight = torch.randn(dim, 4, generator=g, device="cuda").to(torch.bfloat16)
    init = torch.randn(batch, 3, dim, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    theirs, theirs_final = peer_conv(x, weight, None, initial_states=init, return_final_states=True)
    ours, ours_final = tilegym_mamba2.causal_conv1d_fn(x, weight, None, initial_states=init, return_final_states=True)
    assert rel_err(ours, theirs) < 1e-2, f"seed={seed}"
    assert torch.equal(ours_final, theirs_final)


@needs_causal_conv1d
@pytest.mark.parametrize("state_len", [3, 4])
@pytest.mark.parametrize("batching", ["rows", "indices", "circular"])
def test_conv_update_like_causal_conv1d(state_len, batching):
    seed, g = generator()
    batch, dim, slots = 8, 5376, 11
    x = torch.randn(batch, dim, generator=g, device="cuda").to(torch.bfloat16)
    weight = torch.randn(dim, 4, generator=g, device="cuda").to(torch.bfloat16)
    bias = torch.randn(dim, generator=g, device="cuda").to(torch.bfloat16)
    kw = {}
    if batching == "indices":
        if "conv_state_indices" not in inspect.signature(peer_conv_update).parameters:
            pytest.skip("this causal_conv1d has no conv_state_indices")
        kw["conv_state_indices"] = torch.randperm(slots, generator=g, device="cuda")[:batch].to(torch.int32)
    elif batching == "circular":
        kw["cache_seqlens"] = torch.randint(0, 40, (batch,), generator=g, device="cuda", dtype=torch.int32)
    rows = slots if batching == "indices" else batch
    state = torch.randn(rows, dim, state_len, generator=g, device="cuda").to(torch.bfloat16)
    theirs_state = state.clone()
    theirs = peer_conv_update(x, theirs_state, weight, bias, "silu", **kw)
    ours = tilegym_mamba2.causal_conv1d_update(x, state, weight, bias, "silu", **kw)
    assert rel_err(ours, theirs) < 1e-2, f"seed={seed}"
    assert torch.equal(state, theirs_state), f"seed={seed}"
