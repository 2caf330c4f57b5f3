"""Serving at GPU speed: the serving ops as torch.library custom ops (torch.compile traces them
whole, in-place states declared), and a patched HF model decoding through CUDA graphs
(integrations/hf/decode_graphs.py): greedy tokens equal to the eager patched model's, left padding
included. On the CPU the static-cache step runs without capture; the graphs on the GPU."""
import pytest
import torch
from torch.library import opcheck

import tilegym_mamba2
from tilegym_mamba2 import traced_ops as serving_ops

transformers = pytest.importorskip("transformers")

from tilegym_mamba2.integrations.hf.decode_graphs import (  # noqa: E402
    DecodeGraphs, _get, _slots, disable_decode_graphs, enable_decode_graphs)
from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2  # noqa: E402

from hf_models import greedy, only_5_17, prompt, tiny_mamba2  # noqa: E402 (pytest puts this folder on sys.path)


def _decode_inputs(device="cpu"):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)
    idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    return dict(state=r(4, 2, 16, 16), x=r(3, 2, 16), dt=r(3, 2, 16).abs(), A=-r(2, 16, 16).abs(), B=r(3, 1, 16),
                C=r(3, 1, 16), idx=idx, conv_state=r(4, 6, 3), cx=r(3, 6), w=r(6, 4), X=r(2, 6, 20))


def test_serving_custom_ops_pass_torch_library_checks():
    t = _decode_inputs()
    opcheck(serving_ops.selective_state_update,
            (t["state"].clone(), t["x"], t["dt"], t["A"], t["B"], t["C"], None, None, None, False, t["idx"], ""))
    opcheck(serving_ops.causal_conv1d_update, (t["cx"], t["conv_state"].clone(), t["w"], None, "silu", None,
                                               t["idx"], ""))
    final = t["X"].new_empty(2, 6, 3)
    opcheck(serving_ops._causal_conv1d_fn, (t["X"], t["w"], None, None, None, final, "silu", ""))
    channel_last = t["X"].transpose(1, 2).contiguous().transpose(1, 2)
    opcheck(serving_ops._causal_conv1d_fn, (channel_last, t["w"], None, None, None, None, None, ""))


def _step(t, state, conv_state):
    out, final = tilegym_mamba2.causal_conv1d_fn(t["X"], t["w"], activation="silu", return_final_states=True)
    u = tilegym_mamba2.causal_conv1d_update(t["cx"], conv_state, t["w"], activation="silu",
                                            conv_state_indices=t["idx"])
    y = tilegym_mamba2.selective_state_update(state, t["x"], t["dt"], t["A"], t["B"], t["C"],
                                              state_batch_indices=t["idx"])
    return out, final, u, y


def test_a_decode_step_compiles_without_graph_breaks_and_updates_states_in_place():
    t = _decode_inputs()
    state, conv_state = t["state"].clone(), t["conv_state"].clone()
    eager = _step(t, state, conv_state)
    torch._dynamo.reset()
    compiled = torch.compile(lambda s, c: _step(t, s, c), fullgraph=True, backend="aot_eager")
    state2, conv_state2 = t["state"].clone(), t["conv_state"].clone()
    got = compiled(state2, conv_state2)
    for a, b in zip(eager, got):
        assert torch.equal(a, b)
    assert torch.equal(state, state2) and torch.equal(conv_state, conv_state2)
    assert not torch.equal(state2, t["state"])                      # written in place, through the graph


def _compiled_decode_steps(model, steps, **compile_kw):
    """Greedy decode steps of a patched model, eager and through torch.compile(fullgraph=True),
    each from its own prefill: -> (eager logits, compiled logits), one per step."""
    ids = prompt(batch=2, tokens=9, device=next(model.parameters()).device)

    def decode(step):
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, token, got = out.cache_params, out.logits[:, -1:].argmax(-1), []
            for i in range(steps):
                position = torch.tensor([ids.shape[1] + i], device=ids.device)
                got.append(step(token, cache, position).clone())  # a graph's output is overwritten next step
                token = got[-1][:, -1:].argmax(-1)
        return got

    def eager(token, cache, position):
        return model(input_ids=token, cache_params=cache, use_cache=True, cache_position=position).logits

    torch._dynamo.reset()
    return decode(eager), decode(torch.compile(eager, fullgraph=True, **compile_kw))


@only_5_17
def test_a_patched_models_decode_step_compiles_whole():
    """transformers 5.17's decode step with every piece ours (the serving ops and the norms as
    custom ops) traces as one graph: fullgraph=True raises at any break."""
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    want, got = _compiled_decode_steps(model, 3, backend="aot_eager")
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@only_5_17
def test_gpu_reduce_overhead_compile_of_a_patched_decode_step():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_mamba2(device="cuda")
    apply_tilegym_kernel_to_mamba2(model=model)
    want, got = _compiled_decode_steps(model, 4, mode="reduce-overhead")
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def _left_padded(batch, device):
    ids = prompt(batch=batch, tokens=37, device=device)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :9], ids[0, :9] = 0, 0
    return ids, mask


def _graph_tokens(model, ids, mask, use_graphs, buckets=(1, 4)):
    runner = DecodeGraphs(model, buckets, use_graphs=use_graphs)
    model.forward = runner
    try:
        return greedy(model, ids, attention_mask=mask), runner
    finally:
        del model.forward


@pytest.mark.parametrize("batch", [1, 3])
def test_static_cache_step_gives_the_eager_greedy_tokens(batch):
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    ids, mask = _left_padded(batch, "cpu")
    want = greedy(model, ids, attention_mask=mask)
    got, runner = _graph_tokens(model, ids, mask, use_graphs=False)
    assert torch.equal(got, want)
    assert list(runner.steps) == [1 if batch == 1 else 4]           # the decode steps went the static way


def test_static_cache_step_stops_rows_at_eos_as_the_eager_path_does():
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    ids, mask = _left_padded(3, "cpu")

    def generate(**kw):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **kw)

    eos = int(generate()[0, ids.shape[1] + 2])                      # row 0's third new token
    want = generate(eos_token_id=eos)
    assert (want[0, ids.shape[1] + 3:] == 0).all()                  # row 0 stopped there, padded after
    runner = DecodeGraphs(model, (4,), use_graphs=False)
    model.forward = runner
    try:
        got = generate(eos_token_id=eos)
    finally:
        del model.forward
    assert torch.equal(got, want) and list(runner.steps) == [4]


def test_a_second_generation_gives_the_first_its_cache_back():
    model = tiny_mamba2()
    apply_tilegym_kernel_to_mamba2(model=model)
    runner = DecodeGraphs(model, (4,), use_graphs=False)
    ids, mask = _left_padded(2, "cpu")
    with torch.no_grad():
        first = model(ids, attention_mask=mask, use_cache=True).cache_params
        setattr(first, "_tilegym_mamba2_prefilled", True)
        runner(input_ids=ids[:, -1:], cache_params=first, use_cache=True)
        kept = [t.clone() for t in _states(first)]
        second = model(ids, attention_mask=mask, use_cache=True).cache_params
        setattr(second, "_tilegym_mamba2_prefilled", True)
        runner(input_ids=ids[:, -1:], cache_params=second, use_cache=True)
    for now, then, other in zip(_states(first), kept, _states(second)):
        assert torch.equal(now, then)                               # its own copy again, not the bucket's rows
        assert now.data_ptr() != other.data_ptr()


def _states(cache):
    return [_get(holder, key) for holder, key, _ in _slots(cache)]


def test_enable_refuses_other_models_and_cpu_models():
    with pytest.raises(ValueError, match="CUDA"):
        enable_decode_graphs(tiny_mamba2())
    with pytest.raises(ValueError, match="Mamba2ForCausalLM"):
        enable_decode_graphs(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_gpu_graph_decoding_gives_the_eager_greedy_tokens_in_fp32(batch):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_mamba2(device="cuda")
    apply_tilegym_kernel_to_mamba2(model=model)
    ids, mask = _left_padded(batch, "cuda")
    want = greedy(model, ids, attention_mask=mask)
    assert torch.equal(greedy(tiny_mamba2(device="cuda"), ids, attention_mask=mask), want)   # HF's torch path
    enable_decode_graphs(model, buckets=(1, 4, 8))
    try:
        got = greedy(model, ids, attention_mask=mask)
        again = greedy(model, ids, attention_mask=mask)             # the graphs replayed, a new cache bound
        runner = model._tilegym_mamba2_decode_graphs
        assert all(step.graph is not None for step in runner.steps.values()) and runner.steps
    finally:
        disable_decode_graphs(model)
    assert torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.gpu
def test_gpu_graph_decoding_bf16_logits_and_sampling():
    model = tiny_mamba2(dtype=torch.bfloat16, device="cuda")
    apply_tilegym_kernel_to_mamba2(model=model)
    ids, mask = _left_padded(4, "cuda")
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, do_sample=False, **kw)
        apply_tilegym_kernel_to_mamba2(model=model, cuda_graphs=True)   # the documented switch
        try:
            got = model.generate(ids, do_sample=False, **kw)
            torch.manual_seed(5)
            sampled = model.generate(ids, do_sample=True, top_k=20, **kw).sequences
        finally:
            apply_tilegym_kernel_to_mamba2(model=model)                 # again without: graphs off
        assert not hasattr(model, "_tilegym_mamba2_decode_graphs")
        torch.manual_seed(5)
        sampled_eager = model.generate(ids, do_sample=True, top_k=20, **kw).sequences
    for a, b in zip(got.logits, want.logits):
        assert ((a - b).norm() / b.norm()).item() < 2e-2
    assert sampled.shape == sampled_eager.shape and (sampled[:, :ids.shape[1]] == ids).all()
