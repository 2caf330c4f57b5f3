"""Mamba2ProblemSpec: validation, reproducibility, layouts and references."""

import dataclasses

import pytest
import torch

from tilegym_mamba2.reference import chunked_forward_reference, mamba2_chunk_forward_pytorch, token_recurrence
from tilegym_mamba2.testing import FORWARD_ARGS, Mamba2ProblemSpec, forward_inputs


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(y).any(), "NaN in result"
    y, ref = y.double(), ref.double()
    return ((y - ref).norm() / ref.norm()).item()


def small_spec(**overrides) -> Mamba2ProblemSpec:
    fields = dict(
        batch_size=2, num_tokens=100, num_groups=2, num_heads=4, state_size=16, head_size=8,
        chunk_size=32, device="cpu",
    )
    return Mamba2ProblemSpec(**(fields | overrides))


def test_field_names_and_defaults():
    fields = dataclasses.fields(Mamba2ProblemSpec)
    assert [f.name for f in fields] == [
        "batch_size", "num_tokens", "num_groups", "num_heads", "state_size", "head_size",
        "chunk_size", "dtype", "state_dtype", "device", "seed",
    ]
    spec = Mamba2ProblemSpec(1, 1, 1, 1, 1, 1)
    assert (spec.chunk_size, spec.dtype, spec.state_dtype, spec.seed) == (128, torch.bfloat16, torch.float32, 0)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert spec.device == torch.device(expected)


def test_spec_is_frozen():
    spec = small_spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_tokens = 5


@pytest.mark.parametrize(
    "field,value",
    [
        ("batch_size", 0),
        ("num_tokens", -1),
        ("num_groups", 1.5),
        ("num_heads", True),
        ("state_size", "16"),
        ("head_size", 0),
        ("chunk_size", 0),
        ("dtype", torch.int32),
        ("state_dtype", "float32"),
        ("device", "not-a-device"),
        ("seed", -1),
    ],
)
def test_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        small_spec(**{field: value})


def test_rejects_heads_not_multiple_of_groups():
    with pytest.raises(ValueError, match="num_groups"):
        small_spec(num_heads=6, num_groups=4)


def test_num_chunks_rounds_up():
    assert small_spec(num_tokens=100, chunk_size=32).num_chunks == 4
    assert small_spec(num_tokens=64, chunk_size=32).num_chunks == 2
    assert small_spec(num_tokens=1, chunk_size=128).num_chunks == 1


def test_source_example_call_keys_and_shapes():
    # The documented call, with fewer tokens to stay fast.
    spec = Mamba2ProblemSpec(
        batch_size=4, num_tokens=300, num_groups=1, num_heads=8, state_size=128, head_size=64,
        chunk_size=128, dtype=torch.bfloat16, state_dtype=torch.float32,
    )
    fwd_inputs = spec.get_sample_inputs(with_reference=False, with_backward=False)
    assert set(fwd_inputs) == set(FORWARD_ARGS)
    assert fwd_inputs["x"].shape == (4, 300, 8, 64) and fwd_inputs["x"].dtype == torch.bfloat16
    assert fwd_inputs["b"].shape == fwd_inputs["c"].shape == (4, 300, 1, 128)
    assert fwd_inputs["dt"].shape == (4, 300, 8) and fwd_inputs["dt"].dtype == torch.bfloat16
    assert fwd_inputs["a"].shape == fwd_inputs["d"].shape == (8,)
    assert fwd_inputs["a"].dtype == fwd_inputs["d"].dtype == torch.float32
    assert fwd_inputs["init_state"].shape == (4, 8, 64, 128)
    assert fwd_inputs["init_state"].dtype == torch.float32
    assert fwd_inputs["chunk_size"] == 128
    assert all(t.device == spec.device for t in fwd_inputs.values() if isinstance(t, torch.Tensor))
    out, final = mamba2_chunk_forward_pytorch(**fwd_inputs)
    assert out.shape == (4, 300, 8, 64) and final.shape == (4, 8, 64, 128)


def test_all_keys_shapes_and_dtypes():
    spec = small_spec(dtype=torch.float16, state_dtype=torch.float64)
    inputs = spec.get_sample_inputs()
    assert set(inputs) == set(FORWARD_ARGS) | {"dout", "dfinal_state", "out", "final_state", "decay_cumsum", "chunk_states"}
    assert inputs["dout"].shape == (2, 100, 4, 8) and inputs["dout"].dtype == torch.float16
    assert inputs["dfinal_state"].shape == (2, 4, 8, 16) and inputs["dfinal_state"].dtype == torch.float32
    assert inputs["init_state"].dtype == torch.float64
    assert inputs["out"].shape == (2, 100, 4, 8)
    assert inputs["final_state"].shape == (2, 4, 8, 16)
    assert inputs["decay_cumsum"].shape == (2, 4, 4 * 32)
    assert inputs["chunk_states"].shape == (2, 4, 4, 8, 16)
    for k in ("out", "final_state", "decay_cumsum", "chunk_states"):
        assert inputs[k].dtype == torch.float64


def test_forward_inputs_keeps_only_op_arguments():
    inputs = small_spec().get_sample_inputs()
    fwd = forward_inputs(inputs)
    assert list(fwd) == list(FORWARD_ARGS)
    assert all(fwd[k] is inputs[k] for k in fwd)


def test_same_seed_reproducible_and_flags_do_not_change_inputs():
    first = small_spec(seed=3).get_sample_inputs()
    second = small_spec(seed=3).get_sample_inputs()
    assert set(first) == set(second)
    for k in first:
        assert torch.equal(first[k], second[k]) if k != "chunk_size" else first[k] == second[k], k
    bare = small_spec(seed=3).get_sample_inputs(with_reference=False, with_backward=False)
    for k in FORWARD_ARGS[:-1]:
        assert torch.equal(bare[k], first[k]), k


def test_different_seed_differs():
    one = small_spec(seed=0).get_sample_inputs(with_reference=False)
    two = small_spec(seed=1).get_sample_inputs(with_reference=False)
    for k in ("x", "a", "b", "c", "d", "dt", "init_state", "dout", "dfinal_state"):
        assert not torch.equal(one[k], two[k]), k


def test_inputs_in_distribution():
    inputs = small_spec(num_tokens=500, chunk_size=64).get_sample_inputs(with_reference=False, with_backward=False)
    assert (inputs["dt"] > 0).all()
    assert (inputs["a"] < 0).all() and (inputs["a"] >= -16).all() and (inputs["a"] <= -1).all()
    # silu(randn) is bounded below by min(silu) ~ -0.278.
    for k in ("x", "b", "c"):
        assert inputs[k].float().min() > -0.3
    state = inputs["init_state"]
    assert torch.isfinite(state).all() and state.abs().max() > 0


def test_references_match_token_recurrence():
    inputs = small_spec(dtype=torch.bfloat16).get_sample_inputs(with_backward=False)
    fwd = forward_inputs(inputs)
    out_ref, final_ref = token_recurrence(**{k: v for k, v in fwd.items() if k != "chunk_size"})
    assert rel_err(inputs["out"], out_ref) < 1e-10
    assert rel_err(inputs["final_state"], final_ref) < 1e-10
    assert torch.equal(inputs["chunk_states"][:, :, 0], fwd["init_state"].double())
    # Padded tail (tokens 100..127) is flat.
    g = inputs["decay_cumsum"]
    assert torch.equal(g[:, :, 100:], g[:, :, 99:100].expand(-1, -1, 28))
    out, final = chunked_forward_reference(**fwd)
    assert torch.equal(out, inputs["out"]) and torch.equal(final, inputs["final_state"])


def test_pytorch_backend_on_sample_inputs():
    inputs = small_spec().get_sample_inputs(with_backward=False)
    out, final = mamba2_chunk_forward_pytorch(**forward_inputs(inputs))
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(out, inputs["out"]) < 5e-3
    assert rel_err(final, inputs["final_state"]) < 1e-5
