"""Decode graphs for the hybrids: the static key/value cache's logic on a CPU (the step run on
the bucket's buffers without a graph), the refusals, and on a GPU the graphs themselves. Tiny
random models of transformers' own hybrid classes; greedy tokens with left padding against the
eager patched path and transformers' own."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilegym_mamba2.integrations.hf import decode_graphs  # noqa: E402
from tilegym_mamba2.integrations.hf.decode_graphs import (  # noqa: E402
    DecodeGraphs, check_graphable, enable_decode_graphs)
from tilegym_mamba2.integrations.hf.static_kv import _get, cache_slots  # noqa: E402
from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2  # noqa: E402

from hf_models import HYBRIDS, VOCAB, only_5_17  # noqa: E402
from hf_models import tiny_hybrid as hybrid  # noqa: E402

NEW_TOKENS = 10


def left_padded(batch, device, seed=3, longest=11):
    """Prompts of different lengths, left-padded (pad 0), and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, longest), generator=gen)
    mask = torch.ones(batch, longest, dtype=torch.long)
    for row in range(batch):
        pad = (row * 3) % (longest - 2)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids.to(device), mask.to(device)


def generate(model, ids, mask, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def with_runner(model, runner, ids, mask, new_tokens=NEW_TOKENS):
    model.forward = runner
    try:
        return generate(model, ids, mask, new_tokens)
    finally:
        del model.forward


@pytest.mark.parametrize("model_type", [*sorted(HYBRIDS), pytest.param("falcon_h1", marks=only_5_17)])
def test_static_cache_step_gives_the_eager_tokens_at_three_batch_sizes(model_type):
    """Batches of 1, 5 and 13 left-padded prompts through one runner (buckets 1, 8, 16): the same
    greedy tokens as the eager patched model and as transformers' own torch path."""
    reference = hybrid(model_type)
    model = copy.deepcopy(reference)
    apply_tilegym_kernel_to_mamba2(model=model)
    runner = DecodeGraphs(model, (1, 8, 16), use_graphs=False)
    for batch, bucket in ((1, 1), (5, 8), (13, 16)):
        ids, mask = left_padded(batch, "cpu", seed=batch)
        want = generate(model, ids, mask)
        assert torch.equal(generate(reference, ids, mask), want), "the patched model left transformers' tokens"
        got = with_runner(model, runner, ids, mask)
        assert torch.equal(got, want), f"batch {batch}: static-cache tokens differ from the eager path's"
        assert runner.steps[bucket].static.length == ids.shape[1] + NEW_TOKENS - 1  # decode steps went static
    assert sorted(runner.steps) == [1, 8, 16]


def test_a_generation_past_the_slots_gets_a_longer_cache_or_runs_eagerly(monkeypatch):
    """Without max_cache_len the slots grow when a generation reaches them (a new bucket cache of
    twice the tokens, captured again on a GPU); with it, the steps past it run eagerly. Tokens stay the eager ones."""
    model = hybrid("bamba")
    apply_tilegym_kernel_to_mamba2(model=model)
    ids, mask = left_padded(3, "cpu", longest=6)
    want = generate(model, ids, mask, new_tokens=20)
    monkeypatch.setattr(decode_graphs, "MIN_KV_SLOTS", 1)
    runner = DecodeGraphs(model, (4,), use_graphs=False)
    assert torch.equal(with_runner(model, runner, ids, mask, new_tokens=20), want)
    assert runner.steps[4].static.max_len == 64   # 16 at the first step (2 x 7 rounded up), 64 at the 17th token
    capped = DecodeGraphs(model, (4,), use_graphs=False, max_cache_len=12)
    assert torch.equal(with_runner(model, capped, ids, mask, new_tokens=20), want)
    assert capped.steps[4].static.max_len == 12 and capped.steps[4].static.live is None  # given back at the cap


def test_the_first_generations_cache_gets_its_own_tensors_back():
    """A second generation on the bucket gives the first cache its keys, values and states back,
    cut to the tokens it holds, no longer views of the bucket's buffers."""
    model = hybrid("nemotron_h")
    apply_tilegym_kernel_to_mamba2(model=model)
    runner = DecodeGraphs(model, (4,), use_graphs=False)
    ids, mask = left_padded(2, "cpu")
    caches = []
    for _ in range(2):
        with torch.no_grad():
            # transformers 5.3's hybrids return a cache only when given one; later ones make their own
            given = model.prepare_inputs_for_generation(ids).get("past_key_values")
            out = runner(input_ids=ids, attention_mask=mask, use_cache=True, past_key_values=given)
            cache = out.past_key_values
            step_mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            runner(input_ids=ids[:, -1:], past_key_values=cache, attention_mask=step_mask, use_cache=True)
        caches.append(cache)
    first, static = caches[0], runner.steps[4].static
    mamba, attention = cache_slots(first)
    assert len(mamba) == len(static.mamba) and len(attention) == len(static.attention) > 0
    for (_, *pair), (_, *static_pair) in zip(attention, static.attention):
        for (holder, key), (static_holder, static_key) in zip(pair, static_pair):
            assert _get(holder, key).shape[2] == ids.shape[1] + 1
            assert _get(holder, key).data_ptr() != _get(static_holder, static_key).data_ptr()
    for (holder, key), (static_holder, static_key) in zip(mamba, static.mamba):
        assert _get(holder, key).data_ptr() != _get(static_holder, static_key).data_ptr()


def test_refusals_name_what_cannot_be_graphed():
    with pytest.raises(ValueError, match="Mamba2ForCausalLM or one of"):
        check_graphable(torch.nn.Linear(2, 2))
    moe = hybrid("granitemoehybrid")
    assert moe.config.num_local_experts
    check_graphable(moe, graphs=True)  # expert layers of a known layout are graphed (experts.py)
    with pytest.raises(ValueError, match="needs? the model on a CUDA device|does not have"):
        enable_decode_graphs(moe)
    with pytest.raises(ValueError, match="max_cache_len"):
        DecodeGraphs(hybrid("bamba"), (1,), use_graphs=False, max_cache_len=0)
    for dense in ("bamba", "nemotron_h", "zamba2"):  # a default expert count without expert layers
        check_graphable(hybrid(dense), graphs=True)
    check_graphable(hybrid("nemotron_h-moe"), graphs=True)
    flash = hybrid("bamba")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation|does not have"):
        check_graphable(flash)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["bamba", "granitemoehybrid", "granitemoehybrid-dense", "nemotron_h",
                                        "nemotron_h-moe", "zamba2", pytest.param("falcon_h1", marks=only_5_17)])
def test_gpu_hybrid_graph_decoding_gives_the_eager_tokens_in_fp32(model_type):
    """Batches of 1, 5 and 13 left-padded prompts, then 2 again (another bucket, a second generation):
    the graphs' greedy tokens are transformers' own (the mixture-of-experts hybrids' expert layers
    captured on their device-routed path)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dense = dict(num_local_experts=0) if model_type.endswith("-dense") else {}
    reference = hybrid(model_type.removesuffix("-dense"), device="cuda", **dense)
    model = copy.deepcopy(reference)
    apply_tilegym_kernel_to_mamba2(model=model)
    enable_decode_graphs(model, buckets=(1, 8, 16))
    try:
        for batch in (1, 5, 13, 2):
            ids, mask = left_padded(batch, "cuda", seed=batch)
            want = generate(reference, ids, mask)
            assert torch.equal(generate(model, ids, mask), want), f"batch {batch}"
        assert all(step.graph is not None for step in model.forward.steps.values())
    finally:
        decode_graphs.disable_decode_graphs(model)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["bamba", "granitemoehybrid", "nemotron_h-moe"])
def test_gpu_hybrid_graph_decoding_bf16_logits_within_tolerance(model_type):
    model = hybrid(model_type, device="cuda", dtype=torch.bfloat16)
    apply_tilegym_kernel_to_mamba2(model=model)
    ids, mask = left_padded(5, "cuda")
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)
        enable_decode_graphs(model, buckets=(8,))
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    decode_graphs.disable_decode_graphs(model)
    for ours, theirs in zip(got.scores, want.scores):
        assert torch.isfinite(ours).all()
        assert (ours.float() - theirs.float()).abs().max() <= 0.05 * theirs.float().abs().max()


def test_the_default_stream_stands_in_for_the_current_one_only_during_a_capture():
    """NemotronH's blocks ask for the default stream; while the runner warms up and captures, the
    current stream answers, and torch.cuda.default_stream is torch's own again afterwards, also
    when the capture raises."""
    own = torch.cuda.default_stream
    with pytest.raises(RuntimeError, match="inside"):
        with decode_graphs._current_stream_as_default():
            assert torch.cuda.default_stream is not own
            raise RuntimeError("inside")
    assert torch.cuda.default_stream is own


def test_a_tuple_returning_call_leaves_the_step_output_type_alone():
    """model(..., return_dict=False) through the runner returns the eager tuple; the decode steps
    after it still return the model's output class."""
    model = hybrid("zamba2")
    apply_tilegym_kernel_to_mamba2(model=model)
    runner = DecodeGraphs(model, (4,), use_graphs=False)
    ids, mask = left_padded(2, "cpu")
    with torch.no_grad():
        assert isinstance(runner(input_ids=ids, attention_mask=mask, return_dict=False, use_cache=False), tuple)
    want = generate(model, ids, mask)
    assert torch.equal(with_runner(model, runner, ids, mask), want)
    assert runner.steps[4].static.length == ids.shape[1] + NEW_TOKENS - 1
