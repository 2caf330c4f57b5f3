"""Ahead-of-time compilation of the serving kernels with tileiras, no GPU needed: every
compile-time variant (options on and off, dtypes, tile sizes) a call can launch."""
import pytest
import torch

from tilegym_mamba2.runtime import limits

pytest.importorskip("cuda.tile", reason="cuda-tile is not installed")

from tilegym_mamba2.core.toolchain import diagnose, find_toolchain  # noqa: E402

_TOOLCHAIN = find_toolchain()
if _TOOLCHAIN.tileiras is None:
    pytest.skip("tileiras not found (pip install \"cuda-tile[tileiras]\"): "
                + " ".join(diagnose(_TOOLCHAIN, target="")), allow_module_level=True)

from tilegym_mamba2.aot import (compile_conv_kernels, compile_conv_update_kernels,  # noqa: E402
                                compile_rms_norm_kernels, compile_state_update_kernels)
from tilegym_mamba2.runtime.launch import recording_launches  # noqa: E402


# Each cubin here comes from tileiras, not from an earlier run's cache (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_compile_cache")


def check_one(results, name):
    assert [n for n, _, _ in results] == [name], results
    assert results[0][1] > 0, f"{name}: empty cubin"


STATE_UPDATE_VARIANTS = {
    "mamba2_hf_call": dict(),                                               # tied, D, z, dt_bias, softplus, indices
    "no_options": dict(with_d=False, with_z=False, with_bias=False, softplus=False, with_indices=False),
    "per_channel_dt_a_per_element": dict(tied=False),
    "no_z_no_indices": dict(with_z=False, with_indices=False),
    "z_without_d": dict(with_d=False, with_bias=False),
    "without_heads": dict(without_heads=True, tied=False, head_size=96, state_size=16),
    "fp16": dict(dtype=torch.float16, with_indices=False),
    "fp32_inputs": dict(dtype=torch.float32),
    "bf16_state": dict(state_dtype=torch.bfloat16),
    "groups_and_odd_sizes": dict(heads=12, groups=4, head_size=50, state_size=100),
    "large_state": dict(state_size=256, head_size=32),
    "many_rows": dict(batch=256, slots=300, heads=80),                      # the 4K-element tile
    "int64_indices": dict(index_dtype=torch.int64),
}


@pytest.mark.parametrize("variant", list(STATE_UPDATE_VARIANTS))
def test_state_update_kernel_compiles_sm90(variant):
    check_one(compile_state_update_kernels("sm_90", **STATE_UPDATE_VARIANTS[variant]), "selective_state_update_kernel")


@pytest.mark.parametrize("target", ["sm_80", "sm_100"])
def test_state_update_kernel_compiles_other_targets(target):
    check_one(compile_state_update_kernels(target), "selective_state_update_kernel")


CONV_VARIANTS = {
    "hf_prefill": dict(),                                                   # channel-last, bias, silu
    "seq_idx": dict(with_seq_idx=True),
    "init_and_final": dict(with_init=True, with_final=True),
    "channel_first_no_bias_no_activation": dict(channel_last=False, with_bias=False, activation=None),
    "width2_fp32": dict(width=2, dtype=torch.float32, with_final=True),
    "width3_fp16_short": dict(width=3, dtype=torch.float16, tokens=5, with_init=True, with_final=True),
    "mamba2_2.7b_dim": dict(dim=5376, tokens=64, batch=1),
    "int64_seq_idx": dict(with_seq_idx=True, index_dtype=torch.int64),
}


@pytest.mark.parametrize("variant", list(CONV_VARIANTS))
def test_conv_kernel_compiles_sm90(variant):
    check_one(compile_conv_kernels("sm_90", **CONV_VARIANTS[variant]), "causal_conv1d_kernel")


CONV_UPDATE_VARIANTS = {
    "decode_step": dict(),                                                  # 1 token, indices, bias, silu
    "plain": dict(with_indices=False, with_bias=False, activation=None),
    "circular": dict(circular=True, state_len=8),
    "several_tokens_longer_state": dict(tokens=3, state_len=6, with_indices=False),
    "width2_fp32": dict(width=2, dtype=torch.float32),
    "width3_fp16_circular_long_x": dict(width=3, dtype=torch.float16, tokens=5, state_len=2, circular=True),
    "mamba2_2.7b_dim": dict(dim=5376, batch=256, slots=300),
    "hf_cache_state_len_width": dict(state_len=4),                         # HF keeps conv_kernel entries
    "int64_indices_and_cache_seqlens": dict(circular=True, state_len=8, index_dtype=torch.int64),
}


@pytest.mark.parametrize("variant", list(CONV_UPDATE_VARIANTS))
def test_conv_update_kernel_compiles_sm90(variant):
    check_one(compile_conv_update_kernels("sm_90", **CONV_UPDATE_VARIANTS[variant]), "causal_conv1d_update_kernel")


RMS_NORM_VARIANTS = {
    "mixer_gated_norm": dict(),                                             # bf16, 5120 wide: two column tiles
    "block_norm": dict(width=2560, gated=False),
    "fp32_weight_fp16_groups": dict(width=1000, group_size=250, dtype=torch.float16, weight_dtype=torch.float32),
    "fp32_narrow_rows": dict(width=96, rows=7, gated=False, dtype=torch.float32),  # several rows a block
}


@pytest.mark.parametrize("variant", list(RMS_NORM_VARIANTS))
def test_rms_norm_kernel_compiles_sm90(variant):
    check_one(compile_rms_norm_kernels("sm_90", **RMS_NORM_VARIANTS[variant]), "rms_norm_kernel")


def test_state_update_recognises_expanded_per_head_values():
    """HF's call (dt, A, D, dt_bias expanded with stride 0) is read per head: the kernel gets
    [batch, heads] dt and [heads] A, D, dt_bias views, and no dense copies of them."""
    from tilegym_mamba2.serving.selective_state_update import PER_CHANNEL, PER_ELEMENT, PER_HEAD, run_state_update
    from tilegym_mamba2.serving.validation import check_state_update_args
    batch, heads, p, n = 2, 4, 8, 16
    dt = torch.randn(batch, heads)
    A = torch.randn(heads)
    kw = dict(state=torch.zeros(batch, heads, p, n), x=torch.zeros(batch, heads, p),
              dt=dt[:, :, None].expand(batch, heads, p), A=A[:, None, None].expand(heads, p, n),
              B=torch.zeros(batch, 1, n), C=torch.zeros(batch, 1, n), D=torch.ones(heads)[:, None].expand(heads, p),
              z=None, dt_bias=torch.ones(heads)[:, None].expand(heads, p), dt_softplus=True)
    with recording_launches() as launches:
        run_state_update(check_state_update_args(**kw, limits=limits.PYTORCH))
    (_, args), = launches
    state, x, dt_arg, bias_arg, a_arg, _, _, d_arg = args[:8]
    assert dt_arg.shape == (batch, heads) and dt_arg.data_ptr() == dt.data_ptr()
    assert a_arg.shape == (heads,) and a_arg.data_ptr() == A.data_ptr()
    assert bias_arg.shape == (heads,) and d_arg.shape == (heads,)
    assert args[13:16] == (PER_HEAD, PER_HEAD, PER_HEAD)
    # One value per channel: dt and D read per channel, A per channel when constant along state_size only.
    kw.update(dt=torch.randn(batch, heads, p), D=torch.randn(heads, p), dt_bias=torch.randn(heads, p),
              A=torch.randn(heads, p)[:, :, None].expand(heads, p, n))
    with recording_launches() as launches:
        run_state_update(check_state_update_args(**kw, limits=limits.PYTORCH))
    (_, args), = launches
    assert args[13:16] == (PER_CHANNEL, PER_CHANNEL, PER_CHANNEL) and args[4].shape == (heads, p)
    kw.update(A=torch.randn(heads, p, n))
    with recording_launches() as launches:
        run_state_update(check_state_update_args(**kw, limits=limits.PYTORCH))
    assert launches[0][1][14] == PER_ELEMENT


def test_small_decode_grids_are_launched_as_programmatic_dependents(monkeypatch):
    """Batch 1 and 8 of the 2.7B mixer (320 and 2,560 blocks) are launched with the flag, batch 64
    (20,480 blocks) without it: above 8192 blocks the flag cost 1-3%."""
    from tilegym_mamba2.serving import selective_state_update as ssu
    from tilegym_mamba2.serving.validation import check_state_update_args
    seen = []
    monkeypatch.setattr(ssu, "launch", lambda grid, kernel, args, dependent=False: seen.append((grid, dependent)))
    heads, p, n = 80, 64, 128
    for batch in (1, 8, 64):
        kw = dict(state=torch.zeros(batch, heads, p, n), x=torch.zeros(batch, heads, p), dt=torch.zeros(batch, heads, p),
                  A=torch.zeros(heads, p, n), B=torch.zeros(batch, 1, n), C=torch.zeros(batch, 1, n))
        ssu.run_state_update(check_state_update_args(**kw, limits=limits.PYTORCH))
    assert seen == [((1, 80, 4), True), ((8, 80, 4), True), ((64, 80, 4), False)]
