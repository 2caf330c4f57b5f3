"""The cutile backend against the float64 reference, on a GPU (skipped elsewhere).

Every output buffer starts as NaN (poisoned_outputs), so an unwritten element fails; each
test draws fresh random inputs (the seed is in the failure message)."""
import os
from dataclasses import replace

import pytest
import torch

from tilegym_mamba2.runtime import limits

import tilegym_mamba2
from tilegym_mamba2.ssd.forward import run_stages
from tilegym_mamba2.runtime.launch import poisoned_outputs
from tilegym_mamba2.runtime.tuning import Config, choose_config
from tilegym_mamba2.ssd.reference.forward import chunked_forward_reference, decay_cumsum_reference, chunk_states_reference
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.core.validation import check_forward_args, values

from gpu_checks import fresh_seed, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

# ‖y − ref‖ / ‖ref‖ against float64 on the same (rounded) inputs.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 4e-3, torch.float32: 2e-3}


def sample(batch, tokens, groups, heads, state, head, chunk, dtype=torch.bfloat16, seed=None):
    seed = fresh_seed() if seed is None else seed
    spec = Mamba2ProblemSpec(batch_size=batch, num_tokens=tokens, num_groups=groups, num_heads=heads,
                             state_size=state, head_size=head, chunk_size=chunk, dtype=dtype,
                             device="cuda", seed=seed)
    return spec, spec.get_sample_inputs(with_reference=True, with_backward=False)


CASES = [
    # batch, tokens, groups, heads, state, head, chunk, dtype
    (1, 64, 1, 4, 16, 32, 64, torch.bfloat16),
    (2, 128, 1, 4, 64, 64, 64, torch.bfloat16),
    (1, 256, 2, 8, 128, 64, 128, torch.bfloat16),
    (4, 1024, 4, 8, 128, 64, 128, torch.bfloat16),
    (2, 4096, 1, 8, 128, 64, 128, torch.bfloat16),
    (1, 2048, 1, 4, 256, 64, 128, torch.bfloat16),
    (1, 512, 2, 4, 256, 128, 64, torch.bfloat16),
    (2, 512, 1, 4, 64, 128, 128, torch.bfloat16),
    (3, 640, 1, 6, 64, 32, 64, torch.bfloat16),
    (2, 1024, 2, 8, 128, 64, 64, torch.float16),
    (1, 512, 1, 4, 256, 128, 128, torch.float16),
    (2, 256, 1, 4, 64, 64, 64, torch.float32),
    (1, 512, 2, 4, 128, 32, 128, torch.float32),
    # ragged token counts
    (1, 1, 1, 4, 128, 64, 128, torch.bfloat16),
    (2, 100, 1, 4, 64, 64, 64, torch.bfloat16),
    (2, 1000, 2, 8, 128, 64, 128, torch.bfloat16),
    (1, 4095, 1, 4, 128, 64, 128, torch.bfloat16),
    (1, 1000, 4, 8, 16, 128, 64, torch.float16),
    (1, 100, 1, 4, 128, 64, 128, torch.float32),
]


@pytest.mark.parametrize("batch,tokens,groups,heads,state,head,chunk,dtype", CASES)
def test_forward_matches_reference(batch, tokens, groups, heads, state, head, chunk, dtype):
    spec, inputs = sample(batch, tokens, groups, heads, state, head, chunk, dtype)
    with poisoned_outputs():
        out, final_state = tilegym_mamba2.mamba2_chunk_forward(**forward_inputs(inputs))
    assert out.dtype == dtype and final_state.dtype == torch.float32
    assert out.shape == inputs["out"].shape and final_state.shape == inputs["final_state"].shape
    tol = TOLERANCE[dtype]
    assert rel_err(out, inputs["out"]) < tol, f"out, seed={spec.seed}"
    assert rel_err(final_state, inputs["final_state"]) < tol, f"final_state, seed={spec.seed}"


@pytest.mark.parametrize("chunk,chunks_per_segment,group_scores",
                         [(64, 1, False), (64, 3, False), (128, 2, False), (32, 5, False), (64, 3, True),
                          (32, 5, True), (64, 16, False), (64, 32, True)])  # the last two: one segment per row
def test_every_stage_matches_reference(chunk, chunks_per_segment, group_scores):
    spec, inputs = sample(2, 1000, 2, 4, 64, 64, chunk)
    args = check_forward_args(**forward_inputs(inputs), limits=limits.CUTILE)
    config = Config(chunk_size=chunk, chunks_per_segment=chunks_per_segment, state_head_tile=32,
                    state_tile=32, out_head_tile=64, group_scores=group_scores)
    with poisoned_outputs():
        stages = run_stages(*values(args), config=config)
    x, a, b, c, d, dt, init, chunk = values(args)
    g = decay_cumsum_reference(a, dt, chunk)
    assert rel_err(stages.dt_bht[:, :, :1000], dt.permute(0, 2, 1)) < 1e-6
    assert torch.all(stages.dt_bht[:, :, 1000:] == 0), "padded tokens must have dt = 0"
    assert rel_err(stages.decay_cumsum, g) < 1e-5, f"seed={spec.seed}"
    states, final = chunk_states_reference(x, b, dt, g, init, chunk)
    expected_entry = states[:, :, ::chunks_per_segment].transpose(-1, -2)  # kept [state_size, head_size]
    entry = stages.entry_states.unflatten(2, (-1, b.shape[3]))  # segments stacked with the state's rows
    assert entry.shape == expected_entry.shape
    assert rel_err(entry, expected_entry) < 1e-2, f"seed={spec.seed}"
    assert rel_err(stages.final_state, final) < 1e-2, f"seed={spec.seed}"
    assert rel_err(stages.out, inputs["out"]) < 1e-2, f"seed={spec.seed}"


def test_group_scores_give_the_output_of_scores_in_the_block():
    """C·B^T read from group_scores.py or multiplied in compute_out: the same output."""
    spec, inputs = sample(2, 1500, 2, 32, 128, 64, 128)
    args = check_forward_args(**forward_inputs(inputs), limits=limits.CUTILE)
    x, a, b, c, d, dt, init, chunk = values(args)
    base = choose_config(2, 1500, 2, 32, 64, 128, chunk)  # both paths are forced below
    outs = []
    for group_scores in (True, False):
        with poisoned_outputs():
            outs.append(run_stages(*values(args), config=replace(base, group_scores=group_scores)).out)
    assert rel_err(outs[0], inputs["out"]) < 1e-2, f"seed={spec.seed}"
    assert rel_err(outs[0], outs[1]) < 1e-4, f"seed={spec.seed}"



@pytest.mark.parametrize("group_scores", [False, True])
def test_fp32_forward_follows_torch_matmul_precision(group_scores):
    """fp32 inputs: at PyTorch's default float32 matmul precision ("highest") the forward's mma
    keep fp32 operands, at "high" they take tf32 ones (tensor cores), as torch's own matmuls and
    our backward do: errors at fp32's level and at tf32's (2^-11) respectively, in the output and
    in the state pass (several segments per row), C·B^T multiplied in compute_out or read from
    group_scores."""
    spec, inputs = sample(2, 1000, 1, 16, 128, 64, 128, torch.float32)
    args = check_forward_args(**forward_inputs(inputs), limits=limits.CUTILE)
    config = replace(choose_config(2, 1000, 1, 16, 64, 128, 128), chunk_size=64, chunks_per_segment=3,
                     group_scores=group_scores)
    worst, before = {}, torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            with poisoned_outputs():
                stages = run_stages(*values(args), config=config)
            worst[precision] = max(rel_err(stages.out, inputs["out"]),
                                   rel_err(stages.final_state, inputs["final_state"]))
    finally:
        torch.set_float32_matmul_precision(before)
    assert worst["highest"] < 1e-5, f"seed={spec.seed} {worst}"
    assert 1e-5 < worst["high"] < TOLERANCE[torch.float32], f"seed={spec.seed} {worst}"

def test_no_initial_state_means_zeros():
    spec, inputs = sample(2, 300, 1, 4, 64, 64, 64)
    args = forward_inputs(inputs)
    args["init_state"] = None
    with poisoned_outputs():
        out, final_state = tilegym_mamba2.mamba2_chunk_forward(**args)
    ref_args = dict(args)
    ref_out, ref_final = chunked_forward_reference(**ref_args)
    assert rel_err(out, ref_out) < 1e-2 and rel_err(final_state, ref_final) < 1e-2, f"seed={spec.seed}"


def test_non_contiguous_inputs_are_read_correctly():
    spec, inputs = sample(2, 500, 2, 4, 64, 64, 64)
    args = forward_inputs(inputs)
    # Same values, other memory layouts: heads-major x, a strided slice for dt, transposed b/c storage.
    args["x"] = args["x"].transpose(1, 2).contiguous().transpose(1, 2)
    args["dt"] = torch.stack([args["dt"], args["dt"]], dim=-1)[..., 0]
    args["b"] = args["b"].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    args["c"] = args["c"].permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    assert not args["x"].is_contiguous() and not args["dt"].is_contiguous()
    with poisoned_outputs():
        out, final_state = tilegym_mamba2.mamba2_chunk_forward(**args)
    assert rel_err(out, inputs["out"]) < 1e-2 and rel_err(final_state, inputs["final_state"]) < 1e-2


def test_tilegym_dispatch_runs_our_kernels_and_the_reference():
    tilegym = pytest.importorskip("tilegym")
    tilegym.set_backend("cutile")
    spec, inputs = sample(1, 700, 1, 8, 128, 64, 128)
    args = forward_inputs(inputs)
    ours, _ = tilegym_mamba2.mamba2_chunk_forward(**args)
    via_tilegym, _ = tilegym.ops.mamba2_chunk_forward(**args)
    torch.testing.assert_close(via_tilegym, ours, rtol=0, atol=0)  # same kernels, same bits
    via_pytorch, _ = tilegym.ops.mamba2_chunk_forward(**args, backend="pytorch")
    assert rel_err(via_pytorch, inputs["out"]) < 1e-2


def test_source_example():
    """The example from the source, exactly as written (4 x 16384 tokens, 8 heads)."""
    tilegym = pytest.importorskip("tilegym")
    from tilegym_mamba2 import Mamba2ProblemSpec
    tilegym.set_backend("cutile")
    spec = Mamba2ProblemSpec(batch_size=4, num_tokens=16384, num_groups=1, num_heads=8, state_size=128,
                             head_size=64, chunk_size=128, dtype=torch.bfloat16, state_dtype=torch.float32)
    fwd_inputs = spec.get_sample_inputs(with_reference=False, with_backward=False)
    out, final_state = tilegym.ops.mamba2_chunk_forward(**fwd_inputs)
    ref_out, ref_final = chunked_forward_reference(**fwd_inputs)
    assert rel_err(out, ref_out) < 1e-2 and rel_err(final_state, ref_final) < 1e-2


def test_tuning_measures_once_per_bucket_and_stays_correct(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "1")
    monkeypatch.setenv("TILEGYM_MAMBA2_CACHE_DIR", str(tmp_path))
    spec, inputs = sample(2, 3000, 1, 8, 128, 64, 128)
    out, final_state = tilegym_mamba2.mamba2_chunk_forward(**forward_inputs(inputs))
    assert "tuning" in capsys.readouterr().err and (tmp_path / "configs.json").exists()
    assert rel_err(out, inputs["out"]) < 1e-2 and rel_err(final_state, inputs["final_state"]) < 1e-2
    spec, inputs = sample(2, 4000, 1, 8, 128, 64, 128)   # same bucket: nothing is measured again
    with poisoned_outputs():
        out, _ = tilegym_mamba2.mamba2_chunk_forward(**forward_inputs(inputs))
    assert "tuning" not in capsys.readouterr().err
    assert rel_err(out, inputs["out"]) < 1e-2
