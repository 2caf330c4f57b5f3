"""The layer op on the "cutile" backend against the float64 chunked reference (itself exact
against the token-by-token definition, tests/test_layer_chunked.py), with every output buffer
poisoned with NaN first. Needs a GPU, not mamba_ssm (tests/test_layer_gpu.py compares with it)."""
import pytest
import torch

import tilegym_mamba2
from layer_cases import ALL, CASES, TOL_OURS, Case, assert_close_to_reference, build, reference, rel_err, unpack
from tilegym_mamba2.runtime.launch import poisoned_outputs

pytestmark = pytest.mark.gpu

# Beyond the shared cases: other dtypes and shapes (state 64/256, head 32/128, groups 1 and 8).
EXTRA = [
    Case("fp16_all", [9], 128, ALL + ("D_head",), init="row", final=True, varlen=True, pack="cu", seed=3,
         max_len=900, dtype=torch.float16),
    Case("fp32_all", [[300, 700, 24]], 64, ALL, init="row", final=True, varlen=True, pack="cu", seed=4,
         dtype=torch.float32),
    Case("state64_head128_groups1", [[1000, 1500]], 128, ("D_channel", "z"), init="row", final=True, varlen=True,
         pack="cu", seed=5, shape=(4, 128, 64, 1)),
    Case("state256_head32_groups8", [[64, 1, 900, 35]], 256, ALL, init="row", final=True, varlen=True,
         pack="cu", seed=6, shape=(8, 32, 256, 8)),
    Case("per_sequence_init_64", [64], 64, ALL, init="seq", final=True, varlen=True, pack="cu", seed=71,
         max_len=300),
    Case("global_ids_row_init", [[100, 964], [1, 63, 1000], [1064]], 64, ("D_head",), init="row", final=True,
         pack="seq_idx", seed=73, global_ids=True),
    # 16 and 32 compute_out blocks per C·B^T tile, 32-wide head tiles: the group_scores path
    # (choose_config).
    Case("group_scores_all", [[700, 1500, 33]], 64, ALL, init="row", final=True, varlen=True, pack="cu", seed=8,
         shape=(32, 32, 128, 2)),
    Case("group_scores_state256", [[500, 600], [1100]], 128, ("D_head", "z"), final=True, pack="seq_idx",
         seed=9, shape=(16, 64, 256, 1)),
    Case("per_sequence_init_on_edges", [[64, 128, 1, 63, 65]], 64, ("z",), init="seq", final=True,
         varlen=True, pack="cu_only_ours", seed=72),
]


@pytest.mark.parametrize("case", CASES + EXTRA, ids=[c.id for c in CASES + EXTRA])
def test_cutile_layer_against_float64(case):
    inputs, ours_kw, _, ref_kw, rows = build(case)
    where = f"case {case.id} (rows of {[len(r) for r in rows]} sequences, {inputs['x'].shape[1]} tokens)"
    with poisoned_outputs():
        result = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=case.chunk, **ours_kw,
                                                          backend="cutile")
    out, final, varlen = unpack(result, case.final, case.varlen)
    ref_out, ref_final, ref_varlen = reference(inputs, ref_kw, case.chunk)

    assert out.dtype == inputs["x"].dtype and out.shape == inputs["x"].shape, where
    if case.final:
        assert final.dtype == torch.float32, where
    if case.varlen:
        assert varlen.dtype == inputs["C"].dtype, where
    assert_close_to_reference(where, rows, (out, final, varlen), (ref_out, ref_final, ref_varlen))



def test_fp32_layer_op_follows_torch_matmul_precision():
    """The layer op's own kernels (packed sequences' varlen states, per-sequence initial states)
    follow PyTorch's float32 matmul precision as the plain op's do: at "highest" every output is at
    fp32's level against float64, at "high" each moves from that by tf32's rounding."""
    case = Case("per_sequence_init_fp32", [7], 128, ALL, init="seq", final=True, varlen=True, pack="cu", seed=71,
                dtype=torch.float32)
    inputs, ours_kw, _, ref_kw, rows = build(case)
    results, before = {}, torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            with poisoned_outputs():
                results[precision] = unpack(tilegym_mamba2.mamba_chunk_scan_combined(
                    **inputs, chunk_size=case.chunk, **ours_kw, backend="cutile"), True, True)
    finally:
        torch.set_float32_matmul_precision(before)
    ref = reference(inputs, ref_kw, case.chunk)
    for name, exact, tf32, want in zip(("out", "final", "varlen"), results["highest"], results["high"], ref):
        assert rel_err(exact, want) < 1e-4, f"{name} at highest: {rel_err(exact, want):.3g}"
        assert 1e-6 < rel_err(tf32, exact) < 5e-3, f"{name}: high against highest {rel_err(tf32, exact):.3g}"

def test_no_options_is_the_plain_op(monkeypatch, tmp_path):
    """Without options the layer op runs the plain op's kernels: at the same config (each op
    tunes its own segment length, so both take the heuristic here: no measuring, and no choice
    saved by an earlier test), the same bits."""
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "0")
    monkeypatch.setenv("TILEGYM_MAMBA2_CACHE_DIR", str(tmp_path))
    inputs, _, _, _, _ = build(Case("plain", [[3000]], 128, seed=11))
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    D = torch.randn(x.shape[2], device=x.device)
    init = torch.randn(1, x.shape[2], x.shape[3], B.shape[3], device=x.device)
    out, final = tilegym_mamba2.mamba_chunk_scan_combined(x, dt, A, B, C, 128, D=D, initial_states=init,
                                                          return_final_states=True, backend="cutile")
    plain_out, plain_final = tilegym_mamba2.mamba2_chunk_forward(x, A, B, C, D, dt, init, 128)
    assert torch.equal(out, plain_out) and torch.equal(final, plain_final)


def test_default_backend_on_cuda_is_cutile(monkeypatch):
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "0")  # tuning would call run_layer too
    calls = []
    from tilegym_mamba2.backends import cutile as backend  # the cutile backend's entry point runs the layer
    original = backend.run_layer
    monkeypatch.setattr(backend, "run_layer", lambda *a, **k: calls.append(1) or original(*a, **k))
    inputs, _, _, _, _ = build(Case("plain", [[100]], 64, seed=12))
    tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=64)
    assert calls == [1]


def test_layer_op_tunes_on_itself_once_per_bucket(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "1")
    monkeypatch.setenv("TILEGYM_MAMBA2_CACHE_DIR", str(tmp_path))
    for tokens, tunes in ((3000, True), (2500, False)):  # the second shape is in the first's bucket
        inputs, _, _, ref_kw, _ = build(Case("tuned", [[tokens]], 64, ("z", "D_channel", "dt_bias", "dt_softplus"),
                                             seed=14))
        with poisoned_outputs():
            out = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=64, **ref_kw, backend="cutile")
        err = capsys.readouterr().err
        assert ("tuning" in err and "|layer" in err) == tunes, err
        ref_out, _, _ = reference(inputs, ref_kw, 64)
        assert rel_err(out, ref_out) < TOL_OURS


def test_tilegym_dispatch_reaches_the_cutile_layer_op():
    tilegym = pytest.importorskip("tilegym")
    inputs, _, _, ref_kw, _ = build(Case("plain", [[500]], 64, ("z", "D_channel"), seed=13))
    tilegym.set_backend("cutile")
    out = tilegym.ops.mamba2_chunk_scan_combined(**inputs, chunk_size=64, **ref_kw)
    ref_out, _, _ = reference(inputs, ref_kw, 64)
    assert rel_err(out, ref_out) < TOL_OURS
