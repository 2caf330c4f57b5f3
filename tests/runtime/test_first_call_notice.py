"""A first call that takes a while says so on stderr (runtime/plan.py, first_call_notice); a
planned call, or a quick first call, prints nothing. No test here waits on wall-clock speed: the
slow call blocks until the notice has been printed."""
import pytest

pytest.importorskip("cuda.tile")

from tilegym_mamba2.runtime import plan  # noqa: E402


def test_a_slow_first_call_says_what_it_is_doing_and_when_it_is_done(monkeypatch, capsys):
    monkeypatch.setattr(plan, "NOTICE_AFTER_S", 0.0)
    with plan.first_call_notice("mamba2_chunk_forward", (1, 4095, 4, 64)) as said:
        assert said.wait(timeout=60), "the notice never came"
    err = capsys.readouterr().err
    assert "mamba2_chunk_forward (1, 4095, 4, 64): first call of this signature, compiling" in err
    assert "mamba2_chunk_forward (1, 4095, 4, 64): ready after" in err


def test_a_quick_first_call_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr(plan, "NOTICE_AFTER_S", 3600.0)
    with plan.first_call_notice("mamba2_chunk_backward", (2, 8, 4, 16)) as said:
        pass
    assert not said.is_set() and capsys.readouterr().err == ""


def test_only_calls_without_a_plan_are_watched(monkeypatch):
    """The cutile backend wraps a call in the notice only when its signature has no plan yet."""
    import tilegym_mamba2.backends.cutile as backend
    watched = []
    monkeypatch.setattr(plan, "first_call_notice", lambda op, shape: watched.append(op) or plan.contextlib.nullcontext())
    backend._noticed(None, "mamba2_chunk_forward", (1, 2, 3, 4))
    backend._noticed(object(), "mamba2_chunk_forward", (1, 2, 3, 4))
    assert watched == ["mamba2_chunk_forward"]
