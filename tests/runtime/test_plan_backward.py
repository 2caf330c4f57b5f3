"""The backward's launch plan (runtime/plan.py) on the CPU: a repeated mamba2_chunk_backward
skips its argument checks and launches what the checked call launched; bad input still meets
the checks. Launches are recorded, not run (see test_plan.py)."""
import pytest
import torch

pytest.importorskip("cuda.tile")

from test_plan import FORWARD_CASES, cpu_as_cuda, error_of, forward_inputs, recorded  # noqa: E402,F401
from tilegym_mamba2.runtime import plan  # noqa: E402


def backward_inputs(**case):
    kw = forward_inputs(**case)
    gen = torch.Generator().manual_seed(7)
    batch, _, heads, head_size = kw["x"].shape
    kw["dout"] = torch.randn(kw["x"].shape, generator=gen).to(kw["x"].dtype)
    kw["dfinal_state"] = torch.randn(batch, heads, head_size, kw["b"].shape[3], generator=gen)
    return kw


def backward(**kw):
    from tilegym_mamba2.backends.cutile import mamba2_chunk_backward
    return mamba2_chunk_backward(**kw)


def counting_backward_checks(monkeypatch):
    import tilegym_mamba2.backends.cutile as backend
    calls, original = [], backend.check_backward_args
    monkeypatch.setattr(backend, "check_backward_args", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


CASES = {name: FORWARD_CASES[name] for name in ("ragged, with init", "no init", "head 64, state 128, fp16")}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_planned_backward_launches_what_the_checked_path_launches(case, monkeypatch):
    kw = backward_inputs(**CASES[case])
    checks = counting_backward_checks(monkeypatch)
    first = recorded(backward, kw, kw)
    again = recorded(backward, kw, kw)
    assert checks == [1]  # the plan's: no second check
    plan.forget()
    assert first == again == recorded(backward, kw, kw) and checks == [1, 1] and len(first) >= 3


BACKWARD_BAD = {
    "dout's shape": lambda kw: dict(kw, dout=kw["dout"][:, :-1]),
    "dout an int tensor": lambda kw: dict(kw, dout=kw["dout"].int()),
    "dout on another device": lambda kw: dict(kw, dout=kw["dout"].to("meta")),
    "dfinal_state's shape": lambda kw: dict(kw, dfinal_state=kw["dfinal_state"][..., :-1]),
    "dfinal_state a list": lambda kw: dict(kw, dfinal_state=kw["dfinal_state"].tolist()),
    "b's dtype": lambda kw: dict(kw, b=kw["b"].float()),
    "chunk_size 48": lambda kw: dict(kw, chunk_size=48),
}


@pytest.mark.parametrize("bad", BACKWARD_BAD, ids=list(BACKWARD_BAD))
def test_bad_backward_input_after_a_plan_gets_the_same_error(bad):
    kw = backward_inputs()
    bad_kw = BACKWARD_BAD[bad](kw)
    expected = error_of(backward, bad_kw)  # no plan yet
    recorded(backward, kw, kw)  # settles the good signature's plan
    assert error_of(backward, bad_kw) == expected
    assert error_of(backward, bad_kw) == expected  # a failed call leaves no plan
