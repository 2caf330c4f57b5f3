"""The context-parallel benchmark's same-machine form runs on the CPU and reports each rank."""
import json

import pytest

from tilegym_mamba2.bench.context_parallel import run_context_parallel_bench, summary_bytes


def test_cpu_form_times_both_ranks_and_the_whole_sequence(tmp_path):
    lines = []
    out = tmp_path / "cp.json"
    rows = run_context_parallel_bench(tokens=256, warmup=1, rep=2, out_json=str(out), log=lines.append)
    assert [r["rank"] for r in rows] == [0, 1]
    assert sum(r["slice"] for r in rows) == 256
    for r in rows:
        assert r["forward_ms"] > 0 and r["train_ms"] > 0
    shape = json.loads(out.read_text())["shape"]
    assert rows[0]["bytes_forward"] == summary_bytes(shape)        # one other rank's summary
    assert rows[0]["single_forward_ms"] > 0
    text = "\n".join(lines)
    assert "on the CPU" in text and "one process, whole sequence" in text


@pytest.mark.parametrize("tokens", ["-5", "0", "abc"])
def test_a_bad_tokens_flag_is_refused_at_once(tokens, capsys):
    from tilegym_mamba2.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--context-parallel", f"--tokens={tokens}"])
    assert exit_.value.code == 2
    assert f"--tokens must be a whole number >= 1, got '{tokens}'" in capsys.readouterr().err


def test_fewer_tokens_than_ranks_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="--tokens must be a whole number of at least 2"):
        run_context_parallel_bench(tokens=1, out_json=None)


def test_a_rank_that_fails_stops_the_benchmark_with_its_reason(tmp_path, monkeypatch):
    """A rank's error reaches the parent at once, not after the parent's wait on the ranks."""
    monkeypatch.setenv("TILEGYM_MAMBA2_CP_TIMEOUT", "not a number")   # every rank's first call refuses it
    with pytest.raises(RuntimeError, match="rank [01] failed: ValueError: TILEGYM_MAMBA2_CP_TIMEOUT must be"):
        run_context_parallel_bench(tokens=64, warmup=1, rep=1, out_json=str(tmp_path / "cp.json"))
