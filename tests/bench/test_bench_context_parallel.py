"""The context-parallel benchmark's same-machine form runs on the CPU and reports each rank."""
import json

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
