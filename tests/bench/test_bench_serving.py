"""The serving benchmark on the CPU: its cases, HF-style inputs, HF's torch paths against the
pytorch backend, the report (table, notes, JSON, PNG), and a whole run on tiny shapes with the
pytorch backend as "ours" and a wall-clock timer (timing itself needs a GPU)."""
import dataclasses
import json
import time

import pytest
import torch

from tilegym_mamba2.bench import serving as bs
from tilegym_mamba2.bench import serving_ops as so
from tilegym_mamba2.backends.pytorch import (causal_conv1d_fn_pytorch, causal_conv1d_update_pytorch,
                                              selective_state_update_pytorch)
from tilegym_mamba2.testing import relative_error as rel

TINY = dict(heads=4, head_size=8, state_size=16, groups=2)
TINY_MODEL = bs.ModelCase(hidden=32, heads=4, head_dim=16, state_size=16, groups=2, vocab=64, chunk_size=16,
                          prefill_tokens=40, decode_prompt=5, decode_tokens=3, decode_batches=(1, 2))


def tiny(case, **overrides):
    return dataclasses.replace(case, **{**TINY, "batch": min(case.batch, 3), "seqlen": min(case.seqlen, 37),
                                        **overrides})


def wall_timer(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


# ---------------------------------------------------------------------------------------- cases

def test_cases_are_the_issue_shapes():
    state = [c for c in so.STATE_CASES if not c.graph and not c.indices]
    assert [c.batch for c in state] == [1, 8, 64, 256]
    assert any(c.indices and c.batch == 64 for c in so.STATE_CASES)
    assert any(c.graph for c in so.STATE_CASES)
    assert {c.seqlen for c in so.CONV_CASES} == {2048, 8192} and all(c.batch == 1 for c in so.CONV_CASES)
    assert [c.batch for c in so.CONV_UPDATE_CASES] == [1, 64, 256]
    for c in so.OP_CASES:  # Mamba2-2.7B's mixer
        assert (c.heads, c.head_size, c.state_size, c.groups, c.width) == (80, 64, 128, 1, 4)
        assert c.conv_dim == 5376
    m = bs.MODEL_CASE
    assert (m.layers, m.hidden, m.heads, m.head_dim, m.state_size, m.groups) == (2, 2560, 80, 64, 128, 1)
    assert m.heads * m.head_dim == m.expand * m.hidden and m.prefill_tokens == 2048
    assert len({(c.op, c.name) for c in so.OP_CASES}) == len(so.OP_CASES)  # table rows stay apart


def test_floor_bytes():
    one = so.ServingCase("selective_state_update", 1)
    assert so.floor_bytes(one) == 2 * 80 * 64 * 128 * 4                       # fp32 state in and out
    assert so.floor_bytes(dataclasses.replace(one, batch=64, indices=True)) == 64 * so.floor_bytes(one)
    assert so.floor_bytes(so.ServingCase("causal_conv1d_fn", 1, seqlen=2048)) == 2 * 5376 * 2048 * 2
    assert so.floor_bytes(so.ServingCase("causal_conv1d_update", 2)) == 2 * 5376 * (2 * 4 + 2) * 2


def test_names():
    assert so.ServingCase("selective_state_update", 64, indices=True, graph=True).name == \
        "batch 64, state_batch_indices, CUDA graph"
    assert so.ServingCase("causal_conv1d_fn", 1, seqlen=8192).name == "batch 1, seqlen 8192"


# ------------------------------------------------------------------------ inputs as HF passes them

def test_state_update_inputs_are_hf_style():
    case = tiny(so.ServingCase("selective_state_update", 3, indices=True))
    a = so.state_update_inputs(case, device="cpu")
    p, n = case.head_size, case.state_size
    assert a["dt"].stride(2) == 0 and a["dt_bias"].stride(1) == 0 and a["D"].stride(1) == 0
    assert a["A"].stride()[1:] == (0, 0) and a["A"].shape == (case.heads, p, n) and (a["A"] < 0).all()
    assert a["state"].dtype == torch.float32 and a["x"].dtype == torch.bfloat16 and a["dt_softplus"]
    assert a["state"].shape[0] == 6 and sorted(set(a["state_batch_indices"].tolist())) == \
        sorted(a["state_batch_indices"].tolist())
    assert a["state_batch_indices"].max() < 6


def test_conv_inputs_are_channel_last():
    a = so.conv_inputs(tiny(so.CONV_CASES[0]), device="cpu")
    assert a["x"].shape == (1, TINY["heads"] * TINY["head_size"] + 2 * 2 * 16, 37) and a["x"].stride(1) == 1
    u = so.conv_update_inputs(tiny(so.CONV_UPDATE_CASES[1]), device="cpu")
    assert u["conv_state"].shape[-1] == 4 == u["weight"].shape[1]  # HF's cache keeps width entries


# ---------------------------------------------------------------------- HF's torch paths are right

@pytest.mark.parametrize("indices", [False, True])
def test_torch_state_update_matches_the_pytorch_backend(indices):
    case = tiny(so.ServingCase("selective_state_update", 3, indices=indices))
    a = so.state_update_inputs(case, device="cpu", dtype=torch.float32)
    ref_state, state = a["state"].clone(), a["state"].clone()
    ref = selective_state_update_pytorch(**{**a, "state": ref_state})
    out = so.torch_state_update(**{**a, "state": state})
    assert rel(out, ref) < 1e-5 and rel(state, ref_state) < 1e-6


def test_torch_convolutions_match_the_pytorch_backend():
    a = so.conv_inputs(tiny(so.CONV_CASES[0]), device="cpu", dtype=torch.float32)
    assert rel(so.torch_conv(**a), causal_conv1d_fn_pytorch(**a)) < 1e-6
    u = so.conv_update_inputs(tiny(so.CONV_UPDATE_CASES[1]), device="cpu", dtype=torch.float32)
    state = u["conv_state"].clone()
    ref = causal_conv1d_update_pytorch(**u)
    out = so.torch_conv_update(**{**u, "conv_state": state})
    assert rel(out, ref) < 1e-6 and torch.equal(state, u["conv_state"])


# ------------------------------------------------------------------------------------- the runner

def test_op_case_checks_then_times_every_implementation():
    emitted = []
    rows = so.bench_op_case(tiny(so.STATE_CASES[1]), wall_timer, device="cpu", backend="pytorch",
                            log=lambda line: None, emit=emitted.append)
    names = [r["impl"] for r in rows]
    assert names[0] == "ours" and "torch" in names
    assert all(r["us"] > 0 and r["rel_err"] < so.TOLERANCE for r in rows)
    assert rows[0]["rel_err_vs"]["torch"] < so.TOLERANCE
    assert [r for r in emitted if r is not None] == rows


def test_graph_case_without_cuda_is_a_note_not_a_crash():
    if torch.cuda.is_available():
        pytest.skip("on a GPU the graph is captured")
    rows = so.bench_op_case(tiny(so.STATE_CASES[-1]), wall_timer, device="cpu", backend="pytorch",
                            log=lambda line: None)
    assert all(r["us"] is None and "CUDA graphs need CUDA" in r["note"] for r in rows)
    assert rows[0]["rel_err"] is not None  # checked before the timing failed


def test_whole_run_on_tiny_shapes_writes_json_table_and_png(tmp_path):
    pytest.importorskip("transformers")
    cases = [tiny(c) for c in (so.STATE_CASES[0], so.STATE_CASES[4], so.CONV_CASES[0], so.CONV_UPDATE_CASES[0])]
    out = tmp_path / "serving.json"
    result = bs.run_serving_bench(cases, TINY_MODEL, device="cpu", backend="pytorch", timer=wall_timer,
                                  out_json=str(out), log=lambda line: None)
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    by = {(r["op"], r["case"], r["impl"]): r for r in saved["rows"]}
    for case in cases:
        assert by[(case.op, case.name, "ours")]["us"] > 0
    model = [r for r in saved["rows"] if r["op"] == "model"]
    assert {r["impl"] for r in model} == {"torch", "ours"}
    assert all(r["us"] and r["us"] > 0 for r in model), model
    assert any(r.get("tokens_per_s") for r in model)
    assert "selective_state_update 2" in saved["notes"]["model calls"]  # the patched model ran ours
    table = so.serving_table(saved["rows"], bandwidth=None)
    assert len(table.splitlines()) == 2 + len(cases) + 1 + len(TINY_MODEL.decode_batches)
    pytest.importorskip("matplotlib")
    so.plot_serving(saved["rows"], str(tmp_path / "serving.png"))
    assert (tmp_path / "serving.png").stat().st_size > 1000


def test_a_failing_part_leaves_the_others(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(so, "conv_inputs", broken)
    monkeypatch.setitem(so.OPS, "causal_conv1d_fn", (broken, None, "causal_conv1d_fn_pytorch"))
    cases = [tiny(so.CONV_CASES[0]), tiny(so.CONV_UPDATE_CASES[0])]
    result = bs.run_serving_bench(cases, None, device="cpu", backend="pytorch", timer=wall_timer,
                                  out_json=str(tmp_path / "s.json"), log=lambda line: None)
    assert "boom" in result["notes"][f"causal_conv1d_fn, {cases[0].name}"]
    assert [r["op"] for r in result["rows"]] == ["causal_conv1d_update"] * 2


# ------------------------------------------------------------------------------------- the report

ROWS = [
    dict(op="selective_state_update", case="batch 64", impl="ours", us=80.0, rel_err=1e-3,
         floor_bytes=64 * 5242880, note=""),
    dict(op="selective_state_update", case="batch 64", impl="mamba_ssm", us=100.0, rel_err=1e-3,
         floor_bytes=64 * 5242880, note=""),
    dict(op="selective_state_update", case="batch 64", impl="torch", us=None, rel_err=None,
         floor_bytes=64 * 5242880, note="failed: x"),
    dict(op="causal_conv1d_fn", case="batch 1, seqlen 2048", impl="ours", us=12.0, rel_err=0.5,
         floor_bytes=44040192, note=""),
    dict(op="model", case="decode batch 1, per token", impl="ours", us=2000.0, rel_err=None, floor_bytes=None,
         note="", tokens_per_s=500.0, tol=bs.MODEL_TOLERANCE),
    dict(op="model", case="decode batch 1, per token", impl="torch", us=8000.0, rel_err=None, floor_bytes=None,
         note="", tokens_per_s=125.0, tol=bs.MODEL_TOLERANCE),
]


def test_table_gives_ratios_bandwidth_floor_and_flags():
    lines = so.serving_table(json.loads(json.dumps(ROWS)), bandwidth=4.2e12).splitlines()
    header, _, state, conv, decode = lines
    assert "ours GB/s" in header and "floor" in header
    assert "mamba_ssm 100.0 us" in state and "mamba_ssm 1.25x" in state and "torch failed" in state
    assert f"| {64 * 5242880 / 80e-6 / 1e9:.0f} |" in state                      # ~4194 GB/s
    assert f"{64 * 5242880 / 4.2e12 * 1e6:.1f} us |" in state                     # the floor at 4.2 TB/s
    assert "!err" in conv and "| — | — |" in conv                                  # no peer: no ratio
    assert "2.00 ms (500 tok/s)" in decode and "torch 4.00x" in decode and decode.endswith("| — | — |")


def test_table_without_bandwidth_gives_floor_bytes_and_notes_list():
    assert "335.5 MB" in so.serving_table(ROWS[:1])
    assert so.notes_text({"a": "b", "c": "d"}) == "- a: b\n- c: d"


def test_command_line_knows_serving(capsys):
    if torch.cuda.is_available():
        pytest.skip("runs the benchmark on a GPU")
    from tilegym_mamba2.__main__ import main
    assert main(["bench", "--serving", "--json", "unused.json"]) == 1
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_the_decode_benchs_hybrids_are_graphable_models_of_a_few_billion_parameters():
    """Each --model of `bench --serving --decode-graphs` builds (on the meta device: no memory)
    as its transformers class, passes the decode graphs' checks, and has 1-10 B parameters."""
    transformers = pytest.importorskip("transformers")
    from tilegym_mamba2.bench.decode import HYBRID_SHAPES, hybrid_config
    from tilegym_mamba2.integrations.hf.decode_graphs import HYBRIDS, check_graphable
    for name in HYBRID_SHAPES:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hybrid_config(name, 1000))
        assert type(model).__name__ in HYBRIDS, name
        try:
            check_graphable(model)
        except ValueError as e:  # transformers 5.17+: hybrids are refused, naming the version
            assert transformers.__version__ in str(e)
        assert 1e9 < sum(p.numel() for p in model.parameters()) < 1e10, name


def test_the_weight_read_floor_counts_the_experts_a_batch_hits():
    """A dense model's step reads every weight but the embedding table's unread rows; an expert
    layer's share grows with the batch toward all its experts (uniform routing)."""
    transformers = pytest.importorskip("transformers")
    from tilegym_mamba2.bench.decode import hybrid_config, weight_read_bytes
    with torch.device("meta"):
        dense = transformers.AutoModelForCausalLM.from_config(hybrid_config("bamba", 1000))
        moe = transformers.AutoModelForCausalLM.from_config(hybrid_config("granitemoehybrid_moe", 1000))
    embedding = dense.get_input_embeddings().weight
    every = sum(p.numel() * p.element_size() for p in dense.parameters())
    assert weight_read_bytes(dense, 1) == weight_read_bytes(dense, 64) == every - embedding.numel() * 4
    reads = [weight_read_bytes(moe, batch) for batch in (1, 8, 64, 4096)]
    assert reads == sorted(reads) and reads[0] < 0.3 * reads[-1]
    assert reads[-1] == pytest.approx(sum(p.numel() * p.element_size() for p in moe.parameters())
                                      - (0 if moe.config.tie_word_embeddings else 1536 * 1000 * 4), rel=1e-3)
