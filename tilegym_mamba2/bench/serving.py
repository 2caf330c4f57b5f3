"""The serving ops and a small HF model, side by side, in one process:
``python -m tilegym_mamba2 bench --serving [--json out.json] [--png out.png]``.

Parts (each case, and each implementation in it, is guarded: a failure is a note, not the end):
  selective_state_update  ours (cutile) vs mamba_ssm's Triton kernel and HF's torch decode step, on
                          Mamba2-2.7B decode shapes in HF's form (dt, A, D, dt_bias expanded with
                          stride 0), softplus, z; eager and replayed from a CUDA graph
  causal_conv1d_fn        ours vs causal_conv1d's CUDA extension and HF's torch path (conv1d with
                          groups=dim, padding=width-1, slice, silu), channel-last x as HF passes it
  causal_conv1d_update    ours vs causal_conv1d and HF's roll-and-sum decode step
  model                   a 2-layer Mamba2ForCausalLM with the 2.7B mixer: prefill and greedy decode,
                          patched with apply_tilegym_kernel_to_mamba2 vs unpatched
Every output is checked against the pytorch backend (fp32 arithmetic) before it is timed; in-place
states are timed on a copy per implementation (repeated updates decay, so values stay finite).
Op times are medians with the L2 cache flushed before each call (``bench.measure``); the floor is
the bytes an op must move (for the state update: the fp32 state, read and written) at the
measured device-to-device copy bandwidth. Results go to JSON after every row.
"""
import json
import platform
import time
import traceback
from dataclasses import dataclass

import torch

from ..testing import relative_error
from .serving_ops import OP_CASES, _line, _sync, bench_op_case, implementations

MODEL_TOLERANCE = 5e-2  # patched logits against the unpatched model's, both bf16


@dataclass(frozen=True)
class ModelCase:
    layers: int = 2
    hidden: int = 2560
    heads: int = 80
    head_dim: int = 64
    state_size: int = 128
    groups: int = 1
    expand: int = 2
    vocab: int = 1000
    chunk_size: int = 256
    prefill_tokens: int = 2048
    decode_prompt: int = 16
    decode_tokens: int = 64
    decode_batches: tuple = (1, 8)  # unpatched, HF's torch prefill holds batch x 21 GB at chunk 256


MODEL_CASE = ModelCase()


# ---- the model ------------------------------------------------------------------------------------

def model_config(case: ModelCase):
    import transformers
    return transformers.Mamba2Config(
        vocab_size=case.vocab, hidden_size=case.hidden, num_hidden_layers=case.layers, num_heads=case.heads,
        head_dim=case.head_dim, expand=case.expand, state_size=case.state_size, n_groups=case.groups,
        chunk_size=case.chunk_size, conv_kernel=4, pad_token_id=0, eos_token_id=1, bos_token_id=1)


def wall_ms(fn, reps=3, device="cuda"):
    """Median wall-clock milliseconds of fn (synchronised), after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_model(case: ModelCase = MODEL_CASE, device="cuda", dtype=torch.bfloat16, log=print, emit=None,
                notes=None, reps=3):
    """A random Mamba2ForCausalLM with case's mixer: prefill (one forward of prefill_tokens, ms) and
    greedy decode (per generated token, from generate() with decode_tokens + 1 new tokens minus
    generate() with 1), unpatched and then patched with apply_tilegym_kernel_to_mamba2. Patched
    logits and tokens are checked against the unpatched model's before timing."""
    import sys

    import transformers

    import tilegym_mamba2
    from ..transformers import apply_tilegym_kernel_to_mamba2, revert_tilegym_kernel_to_mamba2
    notes = {} if notes is None else notes
    emit = emit or (lambda row: None)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: fast on a GPU
        model = transformers.Mamba2ForCausalLM(model_config(case)).to(dtype=dtype).eval()
    modeling = sys.modules[type(model).__module__]
    fast = bool(getattr(modeling, "is_fast_path_available", False)) and str(device).startswith("cuda")
    unpatched = "mamba_ssm" if fast else "torch"
    notes["model"] = (f"transformers {transformers.__version__}; unpatched = "
                      + ("HF fast path (mamba_ssm + causal_conv1d)" if fast
                         else "HF torch_forward (fast path unavailable: mamba_ssm/causal_conv1d not found by HF)"))
    gen = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(2, case.vocab, (1, case.prefill_tokens), generator=gen).to(device)
    prompts = {b: torch.randint(2, case.vocab, (b, case.decode_prompt), generator=gen).to(device)
               for b in case.decode_batches}

    def forward():
        with torch.inference_mode():
            return model(prefill_ids, use_cache=False).logits

    def generate(ids, new):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)

    def row(case_name, impl, ms, err=None, note="", **extra):
        r = dict(op="model", case=case_name, impl=impl, us=None if ms is None else ms * 1e3, rel_err=err,
                 floor_bytes=None, note=note, tol=MODEL_TOLERANCE, **extra)
        log(_line(r))
        emit(r)
        return r

    def timings(impl, ref=None):
        """prefill and decode rows for the model as it is now; -> (logits, tokens of the first batch)."""
        logits = tokens = None
        try:
            start = time.perf_counter()
            logits = forward()
            _sync(device)
            first = time.perf_counter() - start
            err = relative_error(logits, ref[0]) if ref and ref[0] is not None else None
            row(f"prefill {case.prefill_tokens} tokens", impl, wall_ms(forward, reps, device), err=err,
                note=f"first call {first:.1f} s")
        except Exception as e:
            row(f"prefill {case.prefill_tokens} tokens", impl, None, note=f"failed: {type(e).__name__}: {str(e)[:160]}")
        for batch, ids in prompts.items():
            name = f"decode batch {batch}, per token"
            try:
                out = generate(ids, case.decode_tokens)
                if out.shape[1] != ids.shape[1] + case.decode_tokens:
                    raise RuntimeError(f"generate gave {out.shape[1] - ids.shape[1]} new tokens")
                if batch == min(prompts):
                    tokens = out[0, ids.shape[1]:]
                one = wall_ms(lambda: generate(ids, 1), reps, device)
                many = wall_ms(lambda: generate(ids, case.decode_tokens + 1), reps, device)
                per_token = max(many - one, 1e-6) / case.decode_tokens
                note = ""
                if ref and batch == min(prompts) and ref[1] is not None:
                    same = int((torch.cumprod((tokens == ref[1]).int(), 0)).sum())
                    note = f"greedy tokens: first {same} of {case.decode_tokens} equal to {unpatched}'s"
                row(name, impl, per_token, tokens_per_s=batch * 1e3 / per_token, note=note)
            except Exception as e:
                row(name, impl, None, note=f"failed: {type(e).__name__}: {str(e)[:160]}")
        return logits, tokens

    ref = timings(unpatched)
    try:
        apply_tilegym_kernel_to_mamba2(model=model)
    except Exception as e:
        notes["model patch"] = f"apply_tilegym_kernel_to_mamba2 raised {type(e).__name__}: {str(e)[:200]}"
        log(notes["model patch"])
        return
    try:
        try:
            counts = _count_calls(tilegym_mamba2, lambda: generate(prompts[min(prompts)], 2))
            notes["model calls"] = "patched generate(2 new tokens) called ours: " + ", ".join(
                f"{k} {v}" for k, v in counts.items())
        except Exception as e:
            notes["model calls"] = f"patched generate failed: {type(e).__name__}: {str(e)[:200]}"
        timings("ours", ref)
    finally:
        revert_tilegym_kernel_to_mamba2(model=model)
        del model
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()


def _count_calls(module, fn):
    """Runs fn with module's four serving/layer functions wrapped by counters; -> the counts."""
    names = ("causal_conv1d_fn", "mamba_chunk_scan_combined", "causal_conv1d_update", "selective_state_update")
    counts = dict.fromkeys(names, 0)
    real = {n: getattr(module, n) for n in names}

    def spy(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return real[name](*args, **kwargs)
        return call
    try:
        for n in names:
            setattr(module, n, spy(n))
        fn()
    finally:
        for n in names:
            setattr(module, n, real[n])
    return counts


# ---- the run ---------------------------------------------------------------------------------------

def run_serving_bench(cases=OP_CASES, model_case=MODEL_CASE, device="cuda", backend="cutile", timer=None,
                      out_json=None, log=print, ops_budget_s=130.0, model_budget_s=170.0):
    """Runs every part; -> result dict(meta, notes, rows), written to out_json after every row.
    timer(fn) -> median ms (default: bench.measure, L2 flushed). Parts, cases and implementations
    fail alone (a note each). No op case starts after ops_budget_s seconds, and the model part
    not after model_budget_s (it takes ~30 s), so that a run fits a 240 s limit."""
    started = time.perf_counter()
    on_cuda = str(device).startswith("cuda")
    if timer is None:
        from .forward import measure
        timer = lambda fn: measure(fn, warmup=10, rep=100)  # noqa: E731
    result = dict(meta=_meta(device), notes={}, rows=[])
    notes = result["notes"]

    def save(row=None):
        if row is not None:
            result["rows"].append(row)
        if out_json:
            with open(out_json, "w") as f:
                json.dump(result, f, indent=1, default=str)

    if on_cuda:
        try:
            from .bench import copy_bandwidth
            result["meta"]["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
        except Exception as e:
            notes["bandwidth"] = f"copy bandwidth not measured: {type(e).__name__}: {e}"
    for op in dict.fromkeys(c.op for c in cases):
        try:
            notes.update({f"{op}: {k}": v for k, v in implementations(op, backend)[1].items()})
        except Exception as e:
            notes[op] = f"failed: {type(e).__name__}: {e}"
    save()
    for case in cases:
        if time.perf_counter() - started > ops_budget_s:
            notes[f"{case.op}, {case.name}"] = "skipped: time budget spent"
            continue
        try:
            bench_op_case(case, timer, device, backend, log, emit=save)
        except Exception as e:
            notes[f"{case.op}, {case.name}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            log(traceback.format_exc(limit=3))
        finally:
            if on_cuda:
                torch.cuda.empty_cache()
    if model_case is not None:
        if time.perf_counter() - started > model_budget_s:
            notes["model"] = "skipped: time budget spent"
        else:
            try:
                bench_model(model_case, device, log=log, emit=save, notes=notes)
            except Exception as e:
                notes["model failure"] = f"{type(e).__name__}: {str(e)[:200]}"
                log(traceback.format_exc(limit=3))
    result["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    save()
    return result


def _meta(device):
    versions = {"torch": torch.__version__}
    for mod in ("cuda.tile", "triton", "transformers", "mamba_ssm", "causal_conv1d", "tilegym"):
        try:
            versions[mod] = getattr(__import__(mod, fromlist=["_"]), "__version__", "?")
        except Exception:
            pass
    gpu = torch.cuda.get_device_name() if str(device).startswith("cuda") else "none"
    return dict(date=time.strftime("%Y-%m-%d %H:%M"), gpu=gpu, host=platform.node(), versions=versions)
