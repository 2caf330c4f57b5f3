"""The quarantine around kernels that keep packed sequences apart by zero weights
(core/quarantine.py): which sequences a non-finite value marks, and that the marked ones, and
only they, come out NaN. On the CPU the backward runs on the reference kernels declared as
not isolating; tests/backends/test_packed_isolation.py runs the cutile backend itself."""
import pytest
import torch

from tilegym_mamba2.backends.pytorch import pytorch_kernels
from tilegym_mamba2.ssd.backward import scan_combined_backward
from tilegym_mamba2.core.quarantine import NothingMarked, Quarantine, all_finite, cleaned, quarantine_layer
from tilegym_mamba2.core.validation import check_scan_combined_args, scan_combined_call
from tilegym_mamba2.runtime import limits

NAN = float("nan")


def test_keys_number_runs_per_row_or_cu_seqlens_sequences():
    seq = torch.tensor([[0, 0, 3, 3, 3], [1, 2, 2, 2, 7]])
    keys = Quarantine(seq, None, 2, 5, "cpu").keys
    assert keys.tolist() == [[0, 0, 1, 1, 1], [5, 6, 6, 6, 7]]
    cu = torch.tensor([0, 2, 5])
    assert Quarantine(None, cu, 1, 5, "cpu").keys.tolist() == [[0, 0, 1, 1, 1]]


def test_marks_reach_only_their_sequence():
    seq = torch.tensor([[0, 0, 1, 1, 2]])
    q = Quarantine(seq, None, 1, 5, "cpu")
    x = torch.ones(1, 5, 3)
    x[0, 3, 1] = float("inf")
    q.mark_tokens(x, None)
    out = q.poison_tokens(torch.zeros(1, 5, 2))
    assert torch.isnan(out[0, 2:4]).all() and (out[0, [0, 1, 4]] == 0).all()
    assert torch.isnan(q.poison_shared(torch.zeros(2))).all()
    assert (q.poison_row_lasts(torch.zeros(1, 4)) == 0).all()     # the row's last sequence is clean


def test_row_initial_state_belongs_to_sequence_0_only():
    q = Quarantine(torch.tensor([[0, 0, 1], [2, 2, 2]]), None, 2, 3, "cpu")
    q.mark_row_firsts(torch.tensor([[0.0], [NAN]]))   # row 1 starts with sequence 2: its state is unused
    assert not (q.marks > 0).any()
    q.mark_row_firsts(torch.tensor([[NAN], [0.0]]))
    out = q.poison_tokens(torch.zeros(2, 3))
    assert torch.isnan(out[0, :2]).all() and (out[0, 2] == 0) and (out[1] == 0).all()


def test_cleaned_keeps_finite_values():
    t = torch.tensor([1.5, NAN, float("inf"), -float("inf"), -2.0])
    assert cleaned(t).tolist() == [1.5, 0.0, 0.0, 0.0, -2.0] and cleaned(None) is None


CU = [0, 17, 50, 70]


def _backward(kernels, dout, inputs):
    call = scan_combined_call(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], 16, D=inputs["D"],
                              z=inputs["z"], dt_bias=inputs["dt_bias"], cu_seqlens=torch.tensor(CU), dt_softplus=True)
    return scan_combined_backward(lambda dtype: kernels, call, dout, None, None, limits=limits.PYTORCH)


@pytest.mark.parametrize("where, token", [("dout", 52), ("x", 20), ("dt", 49)])
def test_quarantined_backward_poisons_the_hit_sequence_and_leaves_the_rest(where, token):
    g = torch.Generator().manual_seed(3)
    t, h, p, n = 70, 2, 4, 4
    inputs = dict(x=torch.randn(1, t, h, p, generator=g), dt=torch.randn(1, t, h, generator=g),
                  A=-torch.rand(h, generator=g) - 0.5, B=torch.randn(1, t, 1, n, generator=g),
                  C=torch.randn(1, t, 1, n, generator=g), D=torch.randn(h, generator=g),
                  z=torch.randn(1, t, h, p, generator=g), dt_bias=torch.randn(h, generator=g))
    dout = torch.randn(1, t, h, p, generator=g)
    leaky = pytorch_kernels(torch.float32)._replace(isolates_sequences=False)
    clean = _backward(leaky, dout, inputs)
    if where == "dout":
        dout = dout.clone()
        dout[0, token, 0, 0] = NAN
    else:
        inputs = dict(inputs, **{where: inputs[where].clone()})
        inputs[where][0, token] = NAN
    grads = _backward(leaky, dout, inputs)
    hit = 2 if token >= 50 else 1
    part = slice(CU[hit], CU[hit + 1])
    for i, name in enumerate(("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias")):
        if name in ("dA", "dD", "ddt_bias"):
            assert torch.isnan(grads[i]).all(), name          # shared by every sequence
            continue
        assert torch.isnan(grads[i][:, part]).all(), name
        rest = torch.ones(t, dtype=torch.bool)
        rest[part] = False
        assert torch.equal(grads[i][:, rest], clean[i][:, rest]), name


def _packed_args(x):
    t, h = x.shape[1], x.shape[2]
    return check_scan_combined_args(x, torch.rand(1, t, h), -torch.ones(h), torch.randn(1, t, 1, 4),
                                    torch.randn(1, t, 1, 4), 16, None, None, None, None, None,
                                    torch.tensor([0, 3, t]), False, (0.0, float("inf")), True, False,
                                    limits=limits.PYTORCH)


def test_all_finite_sees_nan_inf_and_fp32_overflow():
    ok = torch.ones(4, 3, dtype=torch.bfloat16)
    assert all_finite(ok, None, torch.zeros(2)) and all_finite()
    for bad in (NAN, float("inf"), -float("inf")):
        t = ok.clone()
        t[2, 1] = bad
        assert not all_finite(ok, t)
    huge = torch.full((4,), 3e38)           # finite values whose fp32 sum is inf: quarantined
    assert not all_finite(huge)


def test_a_finite_call_skips_the_quarantine_and_a_non_finite_one_takes_it():
    args = _packed_args(torch.randn(1, 8, 2, 4))
    dout = torch.randn(1, 8, 2, 4)
    quarantine, clean, grads = quarantine_layer(args, dout)
    assert isinstance(quarantine, NothingMarked) and clean is args and grads[0] is dout
    dout[0, 5, 1, 2] = NAN                   # a gradient of the second sequence
    quarantine, clean, grads = quarantine_layer(args, dout)
    assert isinstance(quarantine, Quarantine) and torch.isfinite(grads[0]).all()
    out = quarantine.poison_tokens(torch.zeros(1, 8))
    assert torch.isnan(out[0, 3:]).all() and (out[0, :3] == 0).all()


def test_values_near_fp32_limit_take_the_quarantine_and_mark_nothing():
    x = torch.full((1, 8, 2, 4), 3e38)
    quarantine, clean, _ = quarantine_layer(_packed_args(x))
    assert isinstance(quarantine, Quarantine) and not (quarantine.marks > 0).any()
    assert torch.equal(clean.x, x)
