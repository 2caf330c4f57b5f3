"""A decay past fp32's range is the recurrence's limit, on both backends: A = -inf (or an A * dt
that overflows fp32) forgets the state at every token, so each token's output is its own input
term, C_t . (dt_t x_t B_t^T), plus D x_t, and the final state is the last token's input term;
dt = 0 under A = -inf decays nothing (core.tensors.log_decay). Outputs are finite where the
recurrence is; other heads are unchanged; a NaN dt still gives NaN."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.testing import relative_error

BACKENDS = ["pytorch", pytest.param("cutile", marks=pytest.mark.gpu)]
TOKENS, HEADS, P, N = 150, 3, 16, 16


def _inputs(device, extreme):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, TOKENS, HEADS, P, generator=g)
    dt = torch.rand(2, TOKENS, HEADS, generator=g) + 0.05
    B, C = (torch.randn(2, TOKENS, 1, N, generator=g) for _ in range(2))
    A = torch.tensor([extreme, -0.5, -2.0])
    D = torch.randn(HEADS, generator=g)
    init = torch.randn(2, HEADS, P, N, generator=g)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return dict(x=x.to(device, dtype), dt=dt.to(device, dtype), A=A.to(device), B=B.to(device, dtype),
                C=C.to(device, dtype), D=D.to(device)), init.to(device)


def _own_input_term(x, dt, B, C, D):
    """Head 0's outputs and final state when nothing is carried from one token to the next."""
    f = torch.float64
    x0, dt0, B0, C0 = x[..., 0, :].to(f), dt[..., 0].to(f), B[..., 0, :].to(f), C[..., 0, :].to(f)
    y = (C0 * B0).sum(-1)[..., None] * dt0[..., None] * x0 + D[0].to(f) * x0
    final = dt0[:, -1, None, None] * x0[:, -1, :, None] * B0[:, -1, None, :]
    return y, final


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("extreme", [-float("inf"), -1e38, -3e38])
def test_a_decay_past_fp32_is_total(backend, extreme):
    device = "cuda" if backend == "cutile" else "cpu"
    inputs, init = _inputs(device, extreme)
    y, final = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=64, initial_states=init,
                                                        return_final_states=True, backend=backend)
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    want_y, want_final = _own_input_term(inputs["x"], inputs["dt"], inputs["B"], inputs["C"], inputs["D"])
    tol = 2e-2 if device == "cuda" else 1e-5
    assert relative_error(y[..., 0, :], want_y) < tol
    assert relative_error(final[:, 0], want_final) < tol
    # The other heads are the finite recurrence's.
    finite = dict(inputs, A=inputs["A"].clone().fill_(-1.0))
    finite["A"][1:] = inputs["A"][1:]
    ref_y, ref_final, _ = layer_token_recurrence(**finite, initial_states=init)
    assert relative_error(y[..., 1:, :], ref_y[..., 1:, :]) < tol
    assert relative_error(final[:, 1:], ref_final[:, 1:]) < tol

    out, state = tilegym_mamba2.mamba2_chunk_forward(inputs["x"], inputs["A"], inputs["B"], inputs["C"], inputs["D"],
                                                     inputs["dt"], init, 64, backend=backend)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    assert relative_error(out[..., 0, :], want_y) < tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_time_under_an_infinite_decay_decays_nothing_and_nan_stays_nan(backend):
    device = "cuda" if backend == "cutile" else "cpu"
    inputs, init = _inputs(device, -float("inf"))
    inputs["dt"][:, 0] = 0.0   # the first token: no time passes, the initial state carries through it
    y, final = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=64, initial_states=init,
                                                        return_final_states=True, backend=backend)
    assert torch.isfinite(y).all()
    carried = torch.einsum("bpn,bn->bp", init[:, 0].double(), inputs["C"][:, 0, 0].double())
    want = carried + inputs["D"][0].double() * inputs["x"][:, 0, 0].double()
    assert relative_error(y[:, 0, 0], want) < (2e-2 if device == "cuda" else 1e-5)
    inputs["dt"][1, 5, 0] = float("nan")
    y = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=64, backend=backend)
    assert torch.isnan(y[1, 5, 0]).any()
