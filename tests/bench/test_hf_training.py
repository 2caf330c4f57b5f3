"""bench --hf-training's step on the CPU (a tiny Mamba2ForCausalLM, the pytorch backend when patched):
three curves from one initial state on the same batches, the patched one within bf16 noise of fp32."""
import pytest

pytest.importorskip("transformers")

from tilegym_mamba2.bench.hf_training import SHAPES, mamba2_model, run_hf_training_bench  # noqa: E402


def test_three_paths_train_from_one_state_and_the_patched_curve_is_within_bf16_noise():
    result = run_hf_training_bench("tiny", tokens=64, steps=5, device="cpu", log=lambda *a: None)
    paths = [row["path"] for row in result["rows"]]
    assert paths == ["torch path, fp32", "torch path, bf16", "patched, bf16"]
    fp32, torch_bf16, patched = result["rows"]
    assert fp32["max_loss_gap_to_fp32"] == 0 and len(patched["losses"]) == 5
    assert fp32["losses"][0] == pytest.approx(patched["losses"][0], abs=2e-2)  # one initial state, one batch
    assert patched["max_loss_gap_to_fp32"] <= 3 * torch_bf16["max_loss_gap_to_fp32"] + 1e-3
    assert all(row["ms"] > 0 and row["tokens_per_s"] > 0 for row in result["rows"])


def test_the_shapes_are_the_released_models():
    import torch
    with torch.device("meta"):
        small = mamba2_model(SHAPES["130m"], "meta", torch.bfloat16)
        large = mamba2_model(SHAPES["1.3b"], "meta", torch.bfloat16)
    assert 1.1e8 < sum(p.numel() for p in small.parameters()) < 1.5e8
    assert 1.2e9 < sum(p.numel() for p in large.parameters()) < 1.5e9
