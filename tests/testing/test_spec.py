"""Mamba2ProblemSpec: validation, reproducibility, layouts and references."""

import dataclasses

import pytest
import torch

from tilegym_mamba2.backends.pytorch import mamba2_chunk_forward_pytorch
from tilegym_mamba2.ssd.reference.forward import LOG2E, chunked_forward_reference, decay_cumsum_reference, token_recurrence
from tilegym_mamba2.testing import (COTANGENTS, FORWARD_ARGS, FORWARD_REFERENCES, GRADIENT_REFERENCES,
                                    Mamba2ProblemSpec, forward_inputs)
from tilegym_mamba2.testing import relative_error as rel_err


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
        "chunk_size", "dtype", "state_dtype", "device", "seed", "dt_shift",
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
        ("dt_shift", float("nan")),
        ("dt_shift", "0"),
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
    assert set(inputs) == set(FORWARD_ARGS) | set(COTANGENTS) | set(FORWARD_REFERENCES) | set(GRADIENT_REFERENCES)
    assert inputs["dout"].shape == (2, 100, 4, 8) and inputs["dout"].dtype == torch.float16
    assert inputs["dfinal_state"].shape == (2, 4, 8, 16) and inputs["dfinal_state"].dtype == torch.float32
    assert inputs["init_state"].dtype == torch.float64
    shapes = {
        "out": (2, 100, 4, 8), "final_state": (2, 4, 8, 16), "hiddens": (2, 4, 4, 8, 16),
        "chunk_states": (2, 4, 4, 8, 16), "decay_cumsum": (2, 100, 4), "decay_cumsum_loge": (2, 100, 4),
        "dx": (2, 100, 4, 8), "da": (4,), "db": (2, 100, 4, 16), "dc": (2, 100, 4, 16), "dd": (4,),
        "ddt": (2, 100, 4), "dinit_state": (2, 4, 8, 16), "dhiddens": (2, 4, 4, 8, 16),
    }
    assert set(shapes) == set(FORWARD_REFERENCES) | set(GRADIENT_REFERENCES)
    for k, shape in shapes.items():
        assert inputs[k].shape == shape, k
        assert inputs[k].dtype == torch.float64, k
        assert torch.isfinite(inputs[k]).all() and not inputs[k].requires_grad, k


@pytest.mark.parametrize("with_reference,with_backward", [(False, False), (False, True), (True, False)])
def test_flags_choose_the_keys(with_reference, with_backward):
    inputs = small_spec().get_sample_inputs(with_reference=with_reference, with_backward=with_backward)
    expected = set(FORWARD_ARGS)
    expected |= set(COTANGENTS) if with_backward else set()
    expected |= set(FORWARD_REFERENCES) if with_reference else set()
    assert set(inputs) == expected


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


def test_dt_shift_moves_dt():
    """dt = softplus(randn + dt_shift): median softplus(-2) = 0.127 by default, softplus(0) = 0.693
    at TileGym's draw."""
    medians = [small_spec(num_tokens=500, dt_shift=shift).get_sample_inputs(with_reference=False)["dt"].float()
               .median().item() for shift in (-2.0, 0.0)]
    assert 0.1 < medians[0] < 0.16 and 0.6 < medians[1] < 0.8, medians


def test_references_match_token_recurrence():
    inputs = small_spec(dtype=torch.bfloat16).get_sample_inputs(with_backward=False)
    fwd = forward_inputs(inputs)
    out_ref, final_ref = token_recurrence(**{k: v for k, v in fwd.items() if k != "chunk_size"})
    assert rel_err(inputs["out"], out_ref) < 1e-10
    assert rel_err(inputs["final_state"], final_ref) < 1e-10
    assert torch.equal(inputs["chunk_states"][:, :, 0], fwd["init_state"].double())
    assert inputs["hiddens"] is inputs["chunk_states"]
    out, final = chunked_forward_reference(**fwd)
    assert torch.equal(out, inputs["out"]) and torch.equal(final, inputs["final_state"])


def test_pytorch_backend_on_sample_inputs():
    inputs = small_spec().get_sample_inputs(with_backward=False)
    out, final = mamba2_chunk_forward_pytorch(**forward_inputs(inputs))
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(out, inputs["out"]) < 5e-3
    assert rel_err(final, inputs["final_state"]) < 1e-5


# ---------------------------------------------------------------- a drop-in for TileGym's spec
# TileGym's tests/ops/test_mamba2.py builds its spec positionally and reads these keys, inside
# torch.no_grad(); its backward test sums db and dc over the heads of each group itself.

def test_decay_cumsum_per_token_in_both_bases():
    spec = small_spec(num_tokens=100, chunk_size=32)
    inputs = spec.get_sample_inputs(with_backward=False)
    a, dt = inputs["a"].double(), inputs["dt"].double()
    g2, ge = inputs["decay_cumsum"], inputs["decay_cumsum_loge"]
    # Base e: the cumsum of a*dt, restarting at every chunk's first token; base 2 is log2(e) times it.
    for start in range(0, 100, 32):
        part = slice(start, min(start + 32, 100))
        torch.testing.assert_close(ge[:, part], (a * dt[:, part]).cumsum(1), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(g2, ge * LOG2E, rtol=1e-14, atol=0)
    # The same numbers as the kernels' padded [B, H, K * L] layout, before the padding.
    assert torch.equal(g2, decay_cumsum_reference(inputs["a"], inputs["dt"], 32)[:, :, :100].transpose(1, 2))


def test_reads_of_tilegyms_mamba2_tests():
    B, T, G, H, N, P, L = 2, 128, 2, 8, 16, 8, 64
    spec = Mamba2ProblemSpec(B, T, G, H, N, P, L, torch.bfloat16, torch.float32, device="cpu")
    with torch.no_grad():
        r = spec.get_sample_inputs()
    # The forward test: the op's arguments, then out and final_state.
    for k in ("x", "a", "b", "c", "d", "dt", "init_state"):
        assert isinstance(r[k], torch.Tensor), k
    assert r["out"].float().shape == (B, T, H, P) and r["final_state"].float().shape == (B, H, P, N)
    # The backward test: the cotangents as arguments, then these references.
    assert r["dout"].shape == (B, T, H, P) and r["dfinal_state"].shape == (B, H, P, N)
    expected = {"dx": (B, T, H, P), "da": (H,), "dd": (H,), "ddt": (B, T, H), "dinit_state": (B, H, P, N)}
    for k, shape in expected.items():
        assert r[k].float().shape == shape, k
    for k in ("db", "dc"):
        grouped = r[k].reshape(B, T, G, H // G, N).float().sum(3)
        assert grouped.shape == (B, T, G, N), k
    assert r["hiddens"].shape == (B, H, T // L, P, N) and r["dhiddens"].shape == (B, H, T // L, P, N)
    assert r["decay_cumsum"].shape == r["decay_cumsum_loge"].shape == (B, T, H)


def _loss(inputs, out, final):
    return (inputs["dout"].double() * out).sum() + (inputs["dfinal_state"].double() * final).sum()


def _recurrence_gradients(inputs):
    """Float64 autograd through the token recurrence, with b and c in groups: a second path."""
    leaves = {k: inputs[k].detach().double().requires_grad_() for k in FORWARD_ARGS[:-1]}
    out, final = token_recurrence(**leaves)
    grads = torch.autograd.grad(_loss(inputs, out, final), list(leaves.values()))
    return dict(zip(leaves, grads))


@pytest.mark.parametrize("dtype,groups,tokens", [(torch.bfloat16, 2, 100), (torch.float32, 1, 64),
                                                  (torch.float16, 4, 40)])
def test_gradient_references_match_the_recurrence(dtype, groups, tokens):
    spec = small_spec(dtype=dtype, num_groups=groups, num_tokens=tokens, chunk_size=32, seed=5)
    with torch.no_grad():  # as TileGym's test calls it
        inputs = spec.get_sample_inputs()
    ref = _recurrence_gradients(inputs)
    for ours, theirs in (("dx", "x"), ("da", "a"), ("dd", "d"), ("ddt", "dt"), ("dinit_state", "init_state")):
        assert rel_err(inputs[ours], ref[theirs]) < 1e-10, ours
    heads = spec.num_heads
    for ours, theirs in (("db", "b"), ("dc", "c")):
        grouped = inputs[ours].reshape(2, tokens, groups, heads // groups, 16).sum(3)
        assert rel_err(grouped, ref[theirs]) < 1e-10, ours
        # Per head: with one head per group the sums would be the per-head values themselves.
        if heads // groups > 1:
            assert not torch.allclose(inputs[ours][:, :, 0], inputs[ours][:, :, 1])


def test_gradient_references_match_finite_differences():
    """Central differences of L = <dout, out> + <dfinal_state, final_state> along a random
    direction of each input (b and c per head), against the references' inner product with it."""
    spec = small_spec(batch_size=1, num_tokens=21, num_groups=1, num_heads=2, state_size=3, head_size=2,
                      chunk_size=8, dtype=torch.float64, state_dtype=torch.float64, seed=9)
    inputs = spec.get_sample_inputs()
    args = {k: inputs[k].double() for k in FORWARD_ARGS[:-1]}
    # b and c per head: heads read the per-head copies, as groups of one head each.
    args["b"], args["c"] = (args[k].repeat_interleave(2, dim=2) for k in ("b", "c"))
    gen = torch.Generator().manual_seed(1)
    eps = 1e-6
    for name, grad in (("x", "dx"), ("a", "da"), ("b", "db"), ("c", "dc"), ("d", "dd"), ("dt", "ddt"),
                       ("init_state", "dinit_state")):
        v = torch.randn(args[name].shape, generator=gen, dtype=torch.float64)

        def loss_at(step):
            moved = dict(args, **{name: args[name] + step * v})
            return _loss(inputs, *token_recurrence(**moved)).item()

        numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
        analytic = (inputs[grad] * v).sum().item()
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (grad, numeric, analytic)


def test_dhiddens_are_the_gradients_of_the_states_leaving_each_chunk():
    spec = small_spec(num_tokens=100, chunk_size=32, seed=11)   # 4 chunks, the last one ragged
    inputs = spec.get_sample_inputs()
    dh = inputs["dhiddens"]
    assert torch.equal(dh[:, :, -1], inputs["dfinal_state"].double())
    fwd = {k: inputs[k] for k in FORWARD_ARGS[:-1]}
    for k in range(spec.num_chunks - 1):
        # The state leaving chunk k enters chunk k + 1: the rest of the sequence starts from it.
        rest = slice((k + 1) * 32, 100)
        entry = inputs["hiddens"][:, :, k + 1].clone().requires_grad_()
        out, final = token_recurrence(fwd["x"][:, rest], fwd["a"], fwd["b"][:, rest], fwd["c"][:, rest], fwd["d"],
                                      fwd["dt"][:, rest], entry)
        loss = (inputs["dout"][:, rest].double() * out).sum() + (inputs["dfinal_state"].double() * final).sum()
        (expected,) = torch.autograd.grad(loss, entry)
        assert rel_err(dh[:, :, k], expected) < 1e-10, k
    assert rel_err(inputs["dinit_state"], _recurrence_gradients(inputs)["init_state"]) < 1e-10


def test_a_chunk_size_that_is_no_power_of_two_and_a_short_shape_are_named():
    with pytest.raises(ValueError, match=r"chunk_size must be a power of two .* got 100"):
        small_spec(chunk_size=100)
    with pytest.raises(ValueError, match=r"shape must be six sizes .* got \(1, 2, 3\)"):
        Mamba2ProblemSpec.from_shape((1, 2, 3))
