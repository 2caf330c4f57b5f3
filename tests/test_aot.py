"""Ahead-of-time compilation of every kernel with tileiras, no GPU needed.

Compiles go to a fresh cuTile disk cache for this module, so each cubin here really comes
from tileiras and not from an earlier run. A compute_out compile at the model-like default
shape takes ~9 s on two CPU cores, so most cases use smaller tiles; fp32 inputs compile far
more slowly and are left to the GPU tests.
"""
import pytest
import torch

pytest.importorskip("cuda.tile", reason="cuda-tile is not installed")

from tilegym_mamba2.core.toolchain import diagnose, find_toolchain  # noqa: E402

_TOOLCHAIN = find_toolchain()
if _TOOLCHAIN.tileiras is None:
    pytest.skip("tileiras not found (pip install \"cuda-tile[tileiras]\"): "
                + " ".join(diagnose(_TOOLCHAIN, target="")), allow_module_level=True)

from tilegym_mamba2.aot import compile_kernels, compile_layer_kernels  # noqa: E402

KERNELS = ["chunk_cumsum_kernel", "segment_states_kernel", "state_scan_kernel", "compute_out_kernel"]
# Small tiles (head_size 32, state_size 64, chunk 32): every kernel, ~2 s per target.
SMALL = dict(batch=1, tokens=100, heads=4, head_size=32, state_size=64, chunk_size=32)


# Each cubin here comes from tileiras, not from an earlier run's cache (conftest.py).
pytestmark = pytest.mark.usefixtures("fresh_compile_cache")


def check_compiled(results):
    names = [name for name, _, _ in results]
    assert sorted(names) == sorted(KERNELS), names
    assert len(names) == len(set(names)), names
    for name, size, seconds in results:
        assert isinstance(size, int) and size > 0, f"{name}: empty cubin"
        assert seconds >= 0, name
    return dict((name, size) for name, size, _ in results)


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "sm_100"])
def test_compile_for_target(target):
    check_compiled(compile_kernels(target, **SMALL))


def test_compile_default_shape_sm90():
    """The model-like default: head_size 64, state_size 128, chunk 128, bf16."""
    check_compiled(compile_kernels("sm_90"))


def test_compile_without_init_state_sm90():
    # Same shape as the default test, so only the kernels that change recompile.
    check_compiled(compile_kernels("sm_90", with_init_state=False))


def test_compile_fp16_sm90():
    check_compiled(compile_kernels("sm_90", **SMALL, dtype=torch.float16))


def test_compile_large_state_small_head_sm90():
    shape = dict(SMALL, tokens=200, head_size=32, state_size=256, chunk_size=64)
    check_compiled(compile_kernels("sm_90", **shape))


def test_compile_group_scores_path_sm90():
    """16 heads per group: compute_out reads C·B^T from group_scores_kernel."""
    results = compile_kernels("sm_90", **dict(SMALL, heads=32, groups=2))
    names = [name for name, _, _ in results]
    assert sorted(names) == sorted(KERNELS + ["group_scores_kernel"]), names
    assert all(size > 0 for _, size, _ in results)


@pytest.mark.parametrize("per_sequence_init,heads", [(False, 4), (True, 4), (False, 16)])
def test_compile_layer_op_every_option_sm90(per_sequence_init, heads):
    """The layer op's kernels with every option on (dt processing, D per channel, z, packed
    sequences, varlen states, initial states per row or per sequence); at 16 heads per group
    compute_out reads C·B^T from group_scores_kernel."""
    results = compile_layer_kernels("sm_90", tokens=300, heads=heads, head_size=32, state_size=64, chunk_size=32,
                                    per_sequence_init=per_sequence_init)
    names = [name for name, _, _ in results]
    expected = (KERNELS + ["varlen_states_kernel"] + (["sequence_init_kernel"] if per_sequence_init else [])
                + (["group_scores_kernel"] if heads >= 16 else []))
    assert sorted(names) == sorted(expected), names
    assert all(size > 0 for _, size, _ in results)



@pytest.mark.parametrize("dtype,with_init_state,head_size,state_size", [(torch.bfloat16, True, 64, 128),
                                                                        (torch.float16, False, 128, 64)])
def test_compile_the_chained_one_launch_path_sm90(dtype, with_init_state, head_size, state_size):
    """The short rows' one-launch kernel (chained_prefill.py), at its 128-token chunks."""
    results = compile_kernels("sm_90", dtype=dtype, with_init_state=with_init_state, head_size=head_size,
                              state_size=state_size, chained=True)
    assert [name for name, _, _ in results] == ["chained_prefill_kernel"]
    assert all(size > 0 for _, size, _ in results)


def test_compile_the_context_parallel_summary_sm90():
    from tilegym_mamba2.aot import compile_end_state_kernels
    results = compile_end_state_kernels("sm_90", tokens=200, heads=4, head_size=32, state_size=32)
    assert [name for name, _, _ in results] == ["given_decay_cumsum_kernel", "segment_states_kernel",
                                                "state_scan_kernel", "end_state_grads_kernel"]
    assert all(size > 0 for _, size, _ in results)
