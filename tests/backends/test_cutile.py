"""The cutile backend's host code, on the CPU."""
import contextlib
import inspect

import pytest


def test_compile_failures_inside_the_op_are_explained(monkeypatch):
    """A tileiras failure during the op's first call comes back with the toolchain diagnosis;
    any other error passes through untouched."""
    import tilegym_mamba2.backends.cutile as backend

    failure = RuntimeError("Return code 5: failed to compile Tile IR program")
    from tilegym_mamba2.core.validation import ForwardArgs
    monkeypatch.setattr(backend, "check_forward_args", lambda limits, **call: ForwardArgs(**call))
    monkeypatch.setattr(backend, "run_stages", lambda *args: (_ for _ in ()).throw(failure))
    import tilegym_mamba2.core.toolchain as toolchain
    monkeypatch.setattr(toolchain, "explain_compile_failure", lambda exc: "CUDA_HOME is CUDA 13.0; fix: ...")
    with pytest.raises(RuntimeError, match="CUDA_HOME is CUDA 13.0") as info:
        backend.mamba2_chunk_forward(*range(7), 64)
    assert info.value.__cause__ is failure

    monkeypatch.setattr(toolchain, "explain_compile_failure", lambda exc: None)
    with pytest.raises(RuntimeError) as info:
        backend.mamba2_chunk_forward(*range(7), 64)
    assert info.value is failure


def specialization(args) -> tuple:
    """What cuTile's JIT compiles a kernel anew for, as far as the host's arrays go: per array its
    dtype and, per dimension, whether it is 1 and whether it is divisible by 16 (its strides
    likewise), and which arrays overlap in memory (alias groups). Scalars are not specialized."""
    import torch
    arrays = [a for a in args if isinstance(a, torch.Tensor)]
    spans = [(a.data_ptr(), a.data_ptr() + a.element_size() * (1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))))
             for a in arrays]
    overlaps = tuple((i, j) for i in range(len(spans)) for j in range(i)
                     if spans[i][0] < spans[j][1] and spans[j][0] < spans[i][1])
    return tuple((a.dtype, tuple((n == 1, n % 16 == 0) for n in a.shape), tuple(s % 16 == 0 for s in a.stride()))
                 for a in arrays) + (overlaps,)


@pytest.mark.parametrize("shape", [(4, 16384, 1, 8, 64, 128), (2, 1000, 1, 80, 64, 128), (2, 3000, 8, 32, 64, 256)])
def test_every_segment_length_shares_compiled_kernels(shape):
    """The tuner's candidates differ only in the segment length, a runtime argument: each kernel
    must be launched with one specialization for all of them (whole rows included), or the first
    call compiles it once per candidate."""
    pytest.importorskip("cuda.tile")
    import torch
    from tilegym_mamba2.ssd.forward import run_stages
    from tilegym_mamba2.runtime.launch import recording_launches
    from tilegym_mamba2.runtime.tuning import candidates, choose_config, whole_row_chunks
    batch, tokens, groups, heads, head_size, state_size = shape
    x = torch.empty(batch, tokens, heads, head_size, dtype=torch.bfloat16)
    b = torch.empty(batch, tokens, groups, state_size, dtype=torch.bfloat16)
    a, d, dt = torch.empty(heads), torch.empty(heads), torch.empty(batch, tokens, heads, dtype=torch.bfloat16)
    init = torch.empty(batch, heads, head_size, state_size)
    base = choose_config(batch, tokens, groups, heads, head_size, state_size, 128)
    tried = candidates(base, whole_row_chunks(batch, tokens, heads, head_size, base))
    seen = {}
    for config in tried:
        with recording_launches() as launches:
            run_stages(x, a, b, b, d, dt, init, 128, config)
        for kernel, args in launches:
            seen.setdefault(kernel._pyfunc.__name__, set()).add(specialization(args))
    assert len(tried) >= 3 and {name: len(keys) for name, keys in seen.items()} == {name: 1 for name in seen}


def test_one_segment_per_row_skips_the_state_pass():
    """When a segment covers a whole row, compute_out starts from the initial state and leaves the
    final state: no state-pass launches (the launches are recorded, nothing runs)."""
    pytest.importorskip("cuda.tile")
    import torch
    from dataclasses import replace
    from tilegym_mamba2.ssd.forward import run_stages
    from tilegym_mamba2.runtime.launch import recording_launches
    from tilegym_mamba2.runtime.tuning import choose_config
    x, b = torch.randn(2, 300, 4, 32).bfloat16(), torch.randn(2, 300, 1, 64).bfloat16()
    a, d, dt = -torch.rand(4), torch.randn(4), torch.rand(2, 300, 4)
    init = torch.randn(2, 4, 32, 64)
    config = replace(choose_config(2, 300, 1, 4, 32, 64, 64), chunks_per_segment=5, group_scores=False)
    with recording_launches() as launches:
        stages = run_stages(x, a, b, b, d, dt, init, 64, config)
    assert [k._pyfunc.__name__ for k, _ in launches] == ["chunk_cumsum_kernel", "compute_out_kernel"]
    assert torch.equal(stages.entry_states, init.transpose(-1, -2))
    assert stages.final_state.shape == (2, 4, 32, 64)
    with recording_launches() as launches:
        run_stages(x, a, b, b, d, dt, init, 64, replace(config, chunks_per_segment=4))  # 5 chunks: 2 segments
    assert "segment_states_kernel" in [k._pyfunc.__name__ for k, _ in launches]


@pytest.mark.parametrize("dtype,precision,want", [("float32", "highest", False), ("float32", "high", True),
                                                  ("float32", "medium", True), ("bfloat16", "high", False)])
def test_backward_mma_follow_torch_matmul_precision(dtype, precision, want):
    """Every backward kernel with an mma is told to take tf32 operands exactly for fp32 inputs
    under a float32 matmul precision other than "highest" (as PyTorch's matmuls do), and the caller's
    precision is left as it was."""
    pytest.importorskip("cuda.tile")

    import torch
    from tilegym_mamba2.ssd.backward import chunk_backward
    from tilegym_mamba2.runtime.launch import recording_launches
    from tilegym_mamba2.backends.cutile import KERNELS
    batch, tokens, heads, head_size, state_size = 2, 300, 4, 64, 128
    dtype = getattr(torch, dtype)
    x, dout = (torch.zeros(batch, tokens, heads, head_size, dtype=dtype) for _ in range(2))
    b, c = (torch.zeros(batch, tokens, 1, state_size, dtype=dtype) for _ in range(2))
    dt, a, d = torch.zeros(batch, tokens, heads), torch.zeros(heads), torch.zeros(heads)
    init, dfinal = (torch.zeros(batch, heads, head_size, state_size) for _ in range(2))
    with matmul_precision(precision), recording_launches() as launches:
        chunk_backward(KERNELS, x, a, b, c, d, dt, init, dout, dfinal)
    told = tf32_flags(launches)
    assert set(told) == {"chunk_states_walk_kernel", "chunk_grads_columns_kernel", "chunk_grads_rows_kernel"}, told
    assert all(flags == {want} for flags in told.values()), told


@pytest.mark.parametrize("dtype,precision,want", [("float32", "highest", False), ("float32", "high", True),
                                                  ("bfloat16", "high", False)])
def test_forward_mma_follow_torch_matmul_precision(dtype, precision, want):
    """As the backward's: every forward kernel with an mma, the plain op's (C·B^T from
    group_scores and in compute_out) and the layer op's packed-sequence ones, is told to take tf32
    operands exactly for fp32 inputs under a precision other than "highest", as PyTorch's matmuls do."""
    pytest.importorskip("cuda.tile")
    from dataclasses import replace

    import torch
    from tilegym_mamba2.ssd.forward import run_stages
    from tilegym_mamba2.runtime.launch import recording_launches
    from tilegym_mamba2.core.validation import scan_combined_call
    from tilegym_mamba2.ssd.layer import run_layer
    from tilegym_mamba2.runtime.tuning import choose_config
    tokens, heads, head_size, state_size = 300, 16, 64, 128
    dtype = getattr(torch, dtype)
    x, z = (torch.zeros(1, tokens, heads, head_size, dtype=dtype) for _ in range(2))
    b = torch.zeros(1, tokens, 1, state_size, dtype=dtype)
    dt, a, d = torch.zeros(1, tokens, heads, dtype=dtype), torch.zeros(heads), torch.zeros(heads)
    cu_seqlens = torch.tensor([0, 100, 300], dtype=torch.int32)
    per_sequence = torch.zeros(2, heads, head_size, state_size)
    base = replace(choose_config(1, tokens, 1, heads, head_size, state_size, 64), chunks_per_segment=2)
    with matmul_precision(precision), recording_launches() as launches:
        for group_scores in (False, True):
            run_stages(x, a, b, b, d, dt, None, 64, replace(base, group_scores=group_scores))
        run_layer(scan_combined_call(x, dt, a, b, b, 64, d, z, d, per_sequence, None, cu_seqlens, True,
                                     (0.0, float("inf")), True, True), config=base)
    told = tf32_flags(launches)
    assert set(told) == {"segment_states_kernel", "compute_out_kernel", "group_scores_kernel",
                         "varlen_states_kernel", "sequence_init_kernel"}, told
    assert all(flags == {want} for flags in told.values()), told


@contextlib.contextmanager
def matmul_precision(precision):
    """torch.set_float32_matmul_precision inside the block, the previous one restored after."""
    import torch
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def tf32_flags(launches) -> dict:
    """kernel name -> the set of values its launches gave a ``tf32`` parameter (kernels without one left out)."""
    told = {}
    for kernel, args in launches:
        names = list(inspect.signature(kernel._pyfunc).parameters)
        if "tf32" in names:
            told.setdefault(kernel._pyfunc.__name__, set()).add(args[names.index("tf32")])
    return told


def test_the_chained_path_is_one_launch_and_reuses_its_workspace():
    """A chained config runs one kernel, allocates the two outputs (and its workspace on the
    first call of a shape only), and all its segment lengths share one specialization."""
    pytest.importorskip("cuda.tile")
    import torch
    from tilegym_mamba2.ssd.forward import run_stages
    from tilegym_mamba2.ssd.chained_prefill import _workspaces
    from tilegym_mamba2.runtime.launch import recording_launches
    from tilegym_mamba2.runtime.tuning import CHAINED_SEGMENTS, chained_config, choose_config
    batch, tokens, heads, head_size, state_size = 1, 1000, 8, 64, 128
    x, b = torch.randn(batch, tokens, heads, head_size).bfloat16(), torch.randn(batch, tokens, 1, state_size).bfloat16()
    a, d, dt = -torch.rand(heads), torch.randn(heads), torch.rand(batch, tokens, heads)
    base = choose_config(batch, tokens, 1, heads, head_size, state_size, 128)
    _workspaces.clear()
    specializations, first_launch_args = set(), {}
    for per_segment in CHAINED_SEGMENTS:
        config = chained_config(base, per_segment)
        with recording_launches() as launches:
            stages = run_stages(x, a, b, b, d, dt, None, 128, config)
        assert [k._pyfunc.__name__ for k, _ in launches] == ["chained_prefill_kernel"]
        assert stages.out.shape == x.shape and stages.final_state.shape == (batch, heads, head_size, state_size)
        specializations.add(specialization(launches[0][1]))
        kernel_args = first_launch_args[per_segment] = launches[0][1]
        sync, sums = kernel_args[11], kernel_args[10]
        assert sync.dtype == torch.int32 and not sync.any()  # counter, fence word and flags all clear
        segments = -(-(-(-tokens // 128)) // per_segment)
        assert sync.numel() >= 2 + segments * heads and kernel_args[12] == per_segment
        assert sums.shape == (2, batch, heads, -(-tokens // 128) * 128) and sums.dtype == torch.float32
    assert len(specializations) == 1
    workspace = next(iter(_workspaces.values()))
    plans = dict(workspace.shapes)
    with recording_launches() as launches:
        run_stages(x, a, b, b, d, dt, None, 128, chained_config(base, CHAINED_SEGMENTS[0]))
    assert workspace.shapes == plans
    first = first_launch_args[CHAINED_SEGMENTS[0]]
    # A repeated shape launches with the very views of its first call: nothing made again.
    assert all(new is old for new, old in zip(launches[0][1][9:12], first[9:12]))


def test_a_chained_call_being_captured_gets_a_workspace_of_its_own(monkeypatch):
    """Graphs captured on one stream may be replayed on several at once: a captured call must not
    share the stream's workspace."""
    pytest.importorskip("cuda.tile")
    import torch
    from tilegym_mamba2.runtime import tuning
    from tilegym_mamba2.ssd.forward import run_stages
    from tilegym_mamba2.ssd.chained_prefill import _workspaces
    from tilegym_mamba2.runtime.launch import recording_launches
    from tilegym_mamba2.runtime.tuning import chained_config, choose_config
    x, b = torch.randn(1, 300, 4, 32).bfloat16(), torch.randn(1, 300, 1, 64).bfloat16()
    a, d, dt = -torch.rand(4), torch.randn(4), torch.rand(1, 300, 4)
    config = chained_config(choose_config(1, 300, 1, 4, 32, 64, 128), 2)
    _workspaces.clear()
    with recording_launches() as launches:
        run_stages(x, a, b, b, d, dt, None, 128, config)
    stream_sync = launches[0][1][11]
    monkeypatch.setattr(tuning.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: True)
    for _ in range(2):
        with recording_launches() as launches:
            run_stages(x, a, b, b, d, dt, None, 128, config)
        assert [k._pyfunc.__name__ for k, _ in launches] == ["chained_prefill_kernel"]
        sync = launches[0][1][11]
        assert sync.data_ptr() != stream_sync.data_ptr() and not sync.any()
    assert len(_workspaces) == 1
