"""Compiling ahead (cutile/compile_ahead.py) on a GPU: a new shape's first backward call finds
every kernel compiled by the threads before it (tileiras runs there, never in the call's own
launches), and gives the same gradients as the second call, which compiles nothing."""
import threading

import pytest
import torch

import tilegym_mamba2

pytestmark = pytest.mark.gpu


def test_first_backward_call_compiles_its_kernels_side_by_side(monkeypatch, tmp_path):
    import cuda.tile._compile as tile_compile
    from cuda.tile._cext import default_tile_context

    # An empty disk cache and a shape no other test uses: every kernel of the call is new.
    monkeypatch.setattr(default_tile_context.config, "cache_dir", str(tmp_path))
    runs = []
    tileiras = tile_compile.compile_cubin

    def counted(*args, **kwargs):
        runs.append(threading.current_thread() is threading.main_thread())
        return tileiras(*args, **kwargs)
    monkeypatch.setattr(tile_compile, "compile_cubin", counted)

    g = torch.Generator(device="cuda").manual_seed(7)
    batch, tokens, heads, head, state = 1, 333, 3, 32, 48
    x = torch.randn(batch, tokens, heads, head, device="cuda", generator=g).to(torch.bfloat16)
    b, c = (torch.randn(batch, tokens, 1, state, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    dt = torch.nn.functional.softplus(torch.randn(batch, tokens, heads, device="cuda", generator=g) - 1)
    a, d = -torch.rand(heads, device="cuda", generator=g) * 4, torch.randn(heads, device="cuda", generator=g)
    init = torch.randn(batch, heads, head, state, device="cuda", generator=g)
    dout = torch.randn_like(x)
    dfinal = torch.randn_like(init)

    first = tilegym_mamba2.mamba2_chunk_backward(x, a, b, c, d, dt, init, dout, dfinal, 64)
    in_threads, in_call = runs.count(False), runs.count(True)
    runs.clear()
    second = tilegym_mamba2.mamba2_chunk_backward(x, a, b, c, d, dt, init, dout, dfinal, 64)
    assert in_threads >= 2 and in_call == 0, f"tileiras runs: {in_threads} in threads, {in_call} in the call"
    assert not runs
    for got, want in zip(first, second):
        assert torch.isfinite(got).all() and torch.equal(got, want)
