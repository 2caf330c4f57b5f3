"""Decoding a Mamba2-2.7B-shaped HF model through CUDA graphs, side by side in one process:
``python -m tilegym_mamba2 bench --serving --decode-graphs``.

A random Mamba2ForCausalLM with the 2.7B model's shape (64 layers, hidden 2560, 80 heads of 64,
state 128; bf16; nothing downloaded), three ways: HF's torch path (unpatched; the fast path needs
mamba_ssm and causal_conv1d), patched with apply_tilegym_kernel_to_mamba2 (eager), and patched
with the decode graphs (tilegym_mamba2.decode_graphs). Per token: the difference of two
generate() calls (new + 1 and 1 new tokens) over ``new``, median of three; the graph's GPU time
of one step: its replay alone, timed with CUDA events. Prefill: one forward of the prompt.
"""
import time

import torch

from .serving import ModelCase, model_config, wall_ms

CASE = ModelCase(layers=64, vocab=1000, prefill_tokens=2048, decode_prompt=16, decode_tokens=16,
                 decode_batches=(1, 8, 64))


def run_decode_bench(case=CASE, log=print, device="cuda", dtype=torch.bfloat16):
    """-> rows: dict(path, what, batch, ms, tokens_per_s, note)."""
    import transformers

    from ..decode_graphs import disable_decode_graphs, enable_decode_graphs
    from ..transformers import apply_tilegym_kernel_to_mamba2
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Mamba2ForCausalLM(model_config(case)).to(dtype=dtype).eval()
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
    del model
    torch.cuda.empty_cache()
    return rows


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
