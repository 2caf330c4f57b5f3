"""Decoding a Mamba2-2.7B-shaped HF model, or a hybrid of a released model's shape, through CUDA
graphs, side by side in one process:
``python -m tilegym_mamba2 bench --serving --decode-graphs [--model NAME]``.

NAME is mamba2 (the default) or a hybrid of HYBRID_SHAPES, built at random init in bf16 from
transformers' own config class (nothing downloaded). For a hybrid the rows are the same three
paths; mamba_ssm has no language model of that structure, so it has no row.

A random Mamba2ForCausalLM with the 2.7B model's shape (64 layers, hidden 2560, 80 heads of 64,
state 128; bf16; nothing downloaded), three ways: HF's torch path (unpatched; the fast path needs
mamba_ssm and causal_conv1d), patched with apply_tilegym_kernel_to_mamba2 (eager), and patched
with the decode graphs (integrations/hf/decode_graphs.py). Per token: the difference of two
generate() calls (new + 1 and 1 new tokens) over ``new``, median of three; the graph's GPU time
of one step: its replay alone, timed with CUDA events. Prefill: one forward of the prompt.

Beside them, where mamba_ssm is importable: its own Mamba-2 language model of the same shape
(MambaLMHeadModel, random, bf16) generating with ``cg=True`` (its whole decode step in a CUDA
graph), the anchor for graph decoding. Without the causal_conv1d extension its convolution runs
in torch (both prefill and the decode step's roll); the rows say so.
"""
import importlib.util
import sys
import time
import types

import torch

from .serving import ModelCase, model_config, wall_ms

CASE = ModelCase(layers=64, vocab=1000, prefill_tokens=2048, decode_prompt=16, decode_tokens=16,
                 decode_batches=(1, 8, 64))

from .model_shapes import HYBRID_SHAPES  # noqa: E402 (the table the command line reads without torch)


def hybrid_config(name, vocab):
    """The transformers config of HYBRID_SHAPES[name] with ``vocab`` tokens, sdpa attention."""
    import transformers
    _, class_name, arguments = HYBRID_SHAPES[name]
    config = getattr(transformers, class_name)(vocab_size=vocab, **arguments)
    config._attn_implementation = "sdpa"
    return config


def run_decode_bench(case=CASE, log=print, device="cuda", dtype=torch.bfloat16, model_name="mamba2"):
    """-> rows: dict(path, what, batch, ms, tokens_per_s, note)."""
    import transformers

    from ..integrations.hf.decode_graphs import disable_decode_graphs, enable_decode_graphs
    from ..transformers import apply_tilegym_kernel_to_mamba2
    torch.manual_seed(0)
    with torch.device(device):
        if model_name == "mamba2":
            model = transformers.Mamba2ForCausalLM(model_config(case)).to(dtype=dtype).eval()
        else:
            model = transformers.AutoModelForCausalLM.from_config(hybrid_config(model_name, case.vocab))
            model = model.to(dtype=dtype).eval()
    log(f"{model_name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, {dtype}")
    gen = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(2, case.vocab, (1, case.prefill_tokens), generator=gen).to(device)
    prompts = {b: torch.randint(2, case.vocab, (b, case.decode_prompt), generator=gen).to(device)
               for b in case.decode_batches}
    rows = []

    def row(path, what, batch, ms, note=""):
        r = dict(path=path, what=what, batch=batch, ms=ms, note=note,
                 tokens_per_s=None if ms is None or batch is None else batch * 1e3 / ms)
        rows.append(r)
        time_text = "-" if ms is None else f"{ms:.3f} ms"
        rate = "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f} tokens/s"
        log(f"{path:>16} | {what:<26} | batch {batch} | {time_text} | {rate} {note}")

    def generate(ids, new):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0)

    def prefill():
        with torch.inference_mode():
            return model(prefill_ids, use_cache=False).logits

    def per_token(ids):
        one = wall_ms(lambda: generate(ids, 1), 3, device)
        many = wall_ms(lambda: generate(ids, case.decode_tokens + 1), 3, device)
        return max(many - one, 1e-6) / case.decode_tokens

    def measure(path, batches=case.decode_batches, with_prefill=True):
        if with_prefill:
            try:
                row(path, f"prefill {case.prefill_tokens} tokens", None, wall_ms(prefill, 3, device))
            except Exception as e:
                row(path, f"prefill {case.prefill_tokens} tokens", None, None, f"failed: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        tokens = {}
        for batch in batches:
            try:
                tokens[batch] = generate(prompts[batch], case.decode_tokens)[:, case.decode_prompt:]
                row(path, "decode, per token", batch, per_token(prompts[batch]))
            except Exception as e:
                row(path, "decode, per token", batch, None, f"failed: {type(e).__name__}: {str(e)[:160]}")
            torch.cuda.empty_cache()
        return tokens

    from .forward import copy_bandwidth
    bandwidth = copy_bandwidth()
    for batch in case.decode_batches:
        row("floor", "weights read per step", batch, weight_read_bytes(model, batch) / bandwidth * 1e3,
            "every weight a step reads once (experts: those a batch hits under uniform routing), at copy bandwidth")
    measure("HF torch path")
    apply_tilegym_kernel_to_mamba2(model=model)
    eager = measure("patched, eager")
    started = time.perf_counter()
    enable_decode_graphs(model)
    try:
        graphed = measure("patched, graphs", with_prefill=False)
        runner = model._tilegym_mamba2_decode_graphs
        for batch in case.decode_batches:
            bucket = next(b for b in runner.buckets if b >= batch)
            step = runner.steps.get(bucket)
            if step is None or step.graph is None:
                continue
            same = "-"
            if batch in eager and batch in graphed:
                first = eager[batch][0] == graphed[batch][0]
                same = f"{int(torch.cumprod(first.int(), 0).sum())} of {case.decode_tokens}"
            row("patched, graphs", "GPU time of one step", batch, _replay_ms(step.graph),
                f"greedy tokens of row 0 equal to eager's: {same}")
        row("patched, graphs", "capture + run, all batches", None, (time.perf_counter() - started) * 1e3)
    finally:
        disable_decode_graphs(model)
    if model_name == "mamba2":
        _mamba_ssm_rows(case, row, prompts, prefill_ids, device, dtype)
    return rows


def weight_read_bytes(model, batch):
    """Bytes of weights one decode step of ``batch`` rows reads at least: every parameter but the input
    embedding's table (a row per token), and of each expert layer the experts the batch is expected
    to hit, E (1 - (1 - k / E)^batch) of E with top k under uniform routing."""
    from ..integrations.hf.experts import expert_layers
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        total -= embedding.numel() * embedding.element_size()
    for module, _ in expert_layers(model):
        experts = getattr(module, "num_experts", None) or module.input_linear.num_experts
        top_k = _top_k(model.config)
        stored = sum(p.numel() * p.element_size() for p in module.parameters() if p.dim() == 3)
        hit = experts * (1 - (1 - top_k / experts) ** batch)
        total -= stored * (1 - hit / experts)
    return total


def _top_k(config):
    return getattr(config, "num_experts_per_tok", None) or 1


def _mamba_ssm_rows(case, row, prompts, prefill_ids, device, dtype):
    path = "mamba_ssm cg=True"
    try:
        model, note = _mamba_ssm_model(case, device, dtype)
    except Exception as e:  # not installed, or its imports fail here
        row(path, "decode, per token", None, None, f"not run: {type(e).__name__}: {str(e)[:160]}")
        return
    from mamba_ssm.utils.generation import InferenceParams
    for batch in case.decode_batches:
        ids = prompts[batch]

        def generate(new, ids=ids):
            with torch.inference_mode():
                return model.generate(ids, max_length=ids.shape[1] + new, cg=True, top_k=1)
        try:
            generate(case.decode_tokens + 1)  # captures its graph for the longest length first
            one = wall_ms(lambda: generate(1), 3, device)
            many = wall_ms(lambda: generate(case.decode_tokens + 1), 3, device)
            row(path, "decode, per token", batch, max(many - one, 1e-6) / case.decode_tokens, note)
        except Exception as e:
            row(path, "decode, per token", batch, None, f"failed: {type(e).__name__}: {str(e)[:160]}")
        torch.cuda.empty_cache()

    def prefill():
        params = InferenceParams(max_seqlen=prefill_ids.shape[1] + 1, max_batch_size=1)
        with torch.inference_mode():
            return model(prefill_ids, inference_params=params, num_last_tokens=1).logits
    try:
        row(path, f"prefill {case.prefill_tokens} tokens", None, wall_ms(prefill, 3, device), note)
    except Exception as e:
        row(path, f"prefill {case.prefill_tokens} tokens", None, None, f"failed: {type(e).__name__}: {str(e)[:160]}")


def _mamba_ssm_model(case, device, dtype):
    """mamba_ssm's MambaLMHeadModel with the case's shape, and a note on what it runs."""
    notes = []
    if importlib.util.find_spec("selective_scan_cuda") is None:
        # Imported by mamba_ssm's package for Mamba-1 only; a Mamba-2 model never calls it.
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    from mamba_ssm.modules import mamba2
    if mamba2.causal_conv1d_update is None:
        notes.append("no causal_conv1d: its conv runs in torch")
    config = MambaConfig(d_model=case.hidden, n_layer=case.layers, vocab_size=case.vocab, pad_vocab_size_multiple=8,
                         ssm_cfg={"layer": "Mamba2", "d_state": case.state_size, "headdim": case.head_dim,
                                  "ngroups": case.groups, "expand": case.expand, "chunk_size": case.chunk_size},
                         rms_norm=True, residual_in_fp32=True, fused_add_norm=True)
    torch.manual_seed(0)
    model = MambaLMHeadModel(config, device=device, dtype=dtype).eval()
    return model, "; ".join(notes)


def _replay_ms(graph, reps=50):
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]
