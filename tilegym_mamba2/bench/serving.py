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
import torch.nn.functional as F

TOLERANCE = 2e-2        # relative error above which an op's result is flagged ("!") in the table
MODEL_TOLERANCE = 5e-2  # patched logits against the unpatched model's, both bf16


@dataclass(frozen=True)
class ServingCase:
    op: str                 # "selective_state_update", "causal_conv1d_fn" or "causal_conv1d_update"
    batch: int
    seqlen: int = 1         # causal_conv1d_fn only
    indices: bool = False   # state_batch_indices over twice as many state rows, shuffled
    graph: bool = False     # timed as the replay of a CUDA graph holding one call
    heads: int = 80         # Mamba2-2.7B's mixer
    head_size: int = 64
    state_size: int = 128
    groups: int = 1
    width: int = 4

    @property
    def conv_dim(self):     # xBC: intermediate (heads * head_size) + B and C
        return self.heads * self.head_size + 2 * self.groups * self.state_size

    @property
    def name(self):
        parts = [f"batch {self.batch}"]
        if self.op == "causal_conv1d_fn":
            parts.append(f"seqlen {self.seqlen}")
        if self.indices:
            parts.append("state_batch_indices")
        if self.graph:
            parts.append("CUDA graph")
        return ", ".join(parts)


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


STATE_CASES = ([ServingCase("selective_state_update", b) for b in (1, 8, 64, 256)]
               + [ServingCase("selective_state_update", 64, indices=True)]
               + [ServingCase("selective_state_update", b, graph=True) for b in (1, 64, 256)])
CONV_CASES = [ServingCase("causal_conv1d_fn", 1, seqlen=s) for s in (2048, 8192)]
CONV_UPDATE_CASES = [ServingCase("causal_conv1d_update", b) for b in (1, 64, 256)]
OP_CASES = STATE_CASES + CONV_CASES + CONV_UPDATE_CASES
MODEL_CASE = ModelCase()


def floor_bytes(case: ServingCase) -> int:
    """Bytes the op must move at least. State update: the fp32 state read and written (x, z, B, C
    and out add under 2%). Convolution: bf16 x read and out written. Convolution step: the bf16
    conv_state (width entries, as HF keeps it) read and written, x read, out written."""
    if case.op == "selective_state_update":
        return 2 * case.batch * case.heads * case.head_size * case.state_size * 4
    if case.op == "causal_conv1d_fn":
        return 2 * case.batch * case.conv_dim * case.seqlen * 2
    return case.batch * case.conv_dim * (2 * case.width + 2) * 2


# ---- inputs, in the form HF's Mamba2Mixer passes them -------------------------------------------

def _random(seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16, device="cpu"):
        return torch.randn(shape, generator=gen).to(device, dtype)
    return gen, randn


def state_update_inputs(case: ServingCase, device="cuda", dtype=torch.bfloat16, seed=0):
    """Keyword arguments of selective_state_update as a bf16 HF model's decode step makes them:
    dt [batch, heads] raw and dt_bias, D [heads] (model dtype), A [heads] fp32, each expanded to
    the per-channel shapes with stride 0; fp32 state; z given; softplus."""
    gen, randn = _random(seed)
    h, p, n, batch = case.heads, case.head_size, case.state_size, case.batch
    slots = 2 * batch if case.indices else batch
    # Mamba-2's initialisation: A in -[1, 16], softplus(dt_bias) log-uniform in [1e-3, 1e-1].
    a = -torch.empty(h).uniform_(1.0, 16.0, generator=gen)
    dt0 = torch.exp(torch.empty(h).uniform_(-6.9, -2.3, generator=gen))
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).to(device, dtype)
    args = dict(state=randn(slots, h, p, n, dtype=torch.float32, device=device),
                x=randn(batch, h, p, dtype=dtype, device=device),
                dt=(randn(batch, h, dtype=torch.float32) * 0.5).to(device, dtype)[:, :, None].expand(-1, -1, p),
                A=a.to(device)[:, None, None].expand(-1, p, n),
                B=randn(batch, case.groups, n, dtype=dtype, device=device),
                C=randn(batch, case.groups, n, dtype=dtype, device=device),
                D=randn(h, dtype=dtype, device=device)[:, None].expand(-1, p),
                z=randn(batch, h, p, dtype=dtype, device=device),
                dt_bias=dt_bias[:, None].expand(-1, p), dt_softplus=True)
    if case.indices:
        args["state_batch_indices"] = torch.randperm(slots, generator=gen)[:batch].to(device, torch.int32)
    return args


def conv_inputs(case: ServingCase, device="cuda", dtype=torch.bfloat16, seed=0):
    """x [batch, dim, seqlen] as the transpose of [batch, seqlen, dim] (HF's layout), weight
    [dim, width], bias [dim], silu."""
    _, randn = _random(seed)
    dim = case.conv_dim
    return dict(x=randn(case.batch, case.seqlen, dim, dtype=dtype, device=device).transpose(1, 2),
                weight=randn(dim, case.width, dtype=dtype, device=device) * 0.5,
                bias=randn(dim, dtype=dtype, device=device), activation="silu")


def conv_update_inputs(case: ServingCase, device="cuda", dtype=torch.bfloat16, seed=0):
    """x [batch, dim]; conv_state [batch, dim, width] as HF's cache keeps it; silu."""
    _, randn = _random(seed)
    dim = case.conv_dim
    return dict(x=randn(case.batch, dim, dtype=dtype, device=device),
                conv_state=randn(case.batch, dim, case.width, dtype=dtype, device=device),
                weight=randn(dim, case.width, dtype=dtype, device=device) * 0.5,
                bias=randn(dim, dtype=dtype, device=device), activation="silu")


# ---- HF's torch paths, as Mamba2Mixer.torch_forward computes them ---------------------------------

def torch_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                       state_batch_indices=None):
    """HF torch_forward's decode step (exp(dt A), dt B x, state * dA + dBx, a bmm with C in C's
    dtype, + x D), plus the z gating and state rows by index that selective_state_update has."""
    batch, heads, head_size = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    rep = heads // B.shape[1]
    dA = torch.exp(dt[..., None] * A)
    dBx = dt[..., None] * B.repeat_interleave(rep, dim=1)[:, :, None, :] * x[..., None]
    rows = state if state_batch_indices is None else state.index_select(0, state_batch_indices.long())
    new = rows * dA + dBx
    if state_batch_indices is None:
        state.copy_(new)
    else:
        state.index_copy_(0, state_batch_indices.long(), new.to(state.dtype))
    c = C.repeat_interleave(rep, dim=1)
    y = torch.bmm(new.to(c.dtype).view(batch * heads, head_size, -1), c.reshape(batch * heads, -1, 1))
    y = y.view(batch, heads, head_size)
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y.to(x.dtype)


def torch_conv(x, weight, bias=None, activation="silu"):
    """HF torch_forward's prefill convolution: nn.Conv1d(groups=dim, padding=width-1), slice, silu."""
    out = F.conv1d(x, weight[:, None, :], bias, padding=weight.shape[1] - 1, groups=x.shape[1])[..., :x.shape[-1]]
    return F.silu(out) if activation in ("silu", "swish") else out


def torch_conv_update(x, conv_state, weight, bias=None, activation="silu"):
    """HF torch_forward's decode convolution: the cache rolls by one, takes x last, then a sum."""
    conv_state.copy_(conv_state.roll(shifts=-1, dims=-1))
    conv_state[:, :, -1] = x
    out = torch.sum(conv_state * weight, dim=-1)
    if bias is not None:
        out = out + bias
    return F.silu(out) if activation in ("silu", "swish") else out


# ---- implementations per op -----------------------------------------------------------------------

OPS = {  # op -> (inputs, the argument updated in place or None, pytorch-backend reference)
    "selective_state_update": (state_update_inputs, "state", "selective_state_update_pytorch"),
    "causal_conv1d_fn": (conv_inputs, None, "causal_conv1d_fn_pytorch"),
    "causal_conv1d_update": (conv_update_inputs, "conv_state", "causal_conv1d_update_pytorch"),
}


def implementations(op, backend="cutile"):
    """-> ({name: fn(**kwargs) -> out}, {peer: why it is missing}) for one op; ours first."""
    import tilegym_mamba2
    found = {"ours": lambda **a: getattr(tilegym_mamba2, op)(**a, backend=backend)}
    notes = {}
    if op == "selective_state_update":
        try:
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update
            found["mamba_ssm"] = selective_state_update
        except Exception as e:  # ImportError, or a CUDA extension that fails to load
            notes["mamba_ssm"] = f"not importable ({type(e).__name__}: {str(e)[:80]})"
        found["torch"] = torch_state_update
    else:
        try:
            import causal_conv1d
            found["causal_conv1d"] = getattr(causal_conv1d, op)
        except Exception as e:
            notes["causal_conv1d"] = f"not importable ({type(e).__name__}: {str(e)[:80]})"
        found["torch"] = torch_conv if op == "causal_conv1d_fn" else torch_conv_update
    return found, notes


def _fresh(args, inplace):
    return {k: (v.clone() if k == inplace else v) for k, v in args.items()}


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def graph_call(fn):
    """A CUDA graph holding one call of fn (warmed up on a side stream first) -> its replay."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need CUDA")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_op_case(case: ServingCase, timer, device="cuda", backend="cutile", log=print, emit=None):
    """Every implementation of case.op on case's inputs: checked against the pytorch backend (output
    and, for in-place ops, the updated state), then timed. -> rows (also passed to emit one by one)."""
    from ..backends import pytorch as serving_reference
    make_inputs, inplace, reference_name = OPS[case.op]
    args = make_inputs(case, device)
    ref_args = _fresh(args, inplace)
    ref_out = getattr(serving_reference, reference_name)(**ref_args)
    impls, _ = implementations(case.op, backend)
    rows, outs = [], {}
    for name, fn in impls.items():
        row = dict(op=case.op, case=case.name, impl=name, us=None, rel_err=None, floor_bytes=floor_bytes(case),
                   note="")
        try:
            if name == "mamba_ssm" and case.indices:
                import inspect
                if "state_batch_indices" not in inspect.signature(fn).parameters:
                    raise TypeError("this mamba_ssm has no state_batch_indices")
            mine = _fresh(args, inplace)
            start = time.perf_counter()
            out = fn(**mine)
            _sync(device)
            first = time.perf_counter() - start
            errors = [rel_err(out, ref_out)] + ([rel_err(mine[inplace], ref_args[inplace])] if inplace else [])
            row["rel_err"] = float("nan") if any(e != e for e in errors) else max(errors)
            outs[name] = out
            call = (lambda: fn(**mine))
            if case.graph:
                call = graph_call(call)
            row["us"] = timer(call) * 1e3
            row["note"] = f"first call {first:.1f} s"
        except Exception as e:
            row["note"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        log(_line(row))
        if emit:
            emit(row)
    if "ours" in outs:  # ours against each peer directly, on the same inputs
        rows[0]["rel_err_vs"] = {k: rel_err(outs["ours"], v) for k, v in outs.items() if k != "ours"}
        if emit:
            emit(None)
    return rows


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
            err = rel_err(logits, ref[0]) if ref and ref[0] is not None else None
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


# ---- report ----------------------------------------------------------------------------------------

def _time(us):
    if us is None:
        return "—"
    return f"{us:.2f} us" if us < 10 else f"{us:.1f} us" if us < 1000 else f"{us / 1e3:.2f} ms"


def _cell(row):
    if row["us"] is None:
        return "failed"
    text = _time(row["us"])
    if row.get("tokens_per_s"):
        text += f" ({row['tokens_per_s']:.0f} tok/s)"
    err = row.get("rel_err")
    if err is not None and not err <= row.get("tol", TOLERANCE):  # NaN flags too
        text += f" !err {err:.0e}"
    return text


def _line(row):
    err = "" if row.get("rel_err") is None else f"  err {row['rel_err']:.1e}"
    return f"{row['op']:22s} {row['case']:36s} {row['impl']:13s} {_cell(row):24s}{err}  {row['note']}"


def serving_table(rows, bandwidth=None) -> str:
    """Markdown: per op and case, our time, each peer's, peer time / ours (> 1: ours is faster), the
    bandwidth ours achieves on the floor's bytes, and the floor (bytes / copy bandwidth)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["case"]), []).append(r)
    lines = ["| op | case | ours | peers | peer / ours (time) | ours GB/s | floor |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (op, case), group in groups.items():
        ours = next((r for r in group if r["impl"] == "ours"), None)
        peers = [r for r in group if r["impl"] != "ours"]
        ours_us = ours["us"] if ours else None
        peer_cells = "; ".join(f"{r['impl']} {_cell(r)}" for r in peers) or "—"
        ratios = "; ".join(f"{r['impl']} {r['us'] / ours_us:.2f}x" for r in peers if r["us"] and ours_us) or "—"
        nbytes = group[0].get("floor_bytes")
        gbs = f"{nbytes / (ours_us * 1e-6) / 1e9:.0f}" if nbytes and ours_us else "—"
        floor = (_time(nbytes / bandwidth * 1e6) if nbytes and bandwidth
                 else f"{nbytes / 1e6:.1f} MB" if nbytes else "—")
        ours_cell = _cell(ours) if ours else "—"
        lines.append(f"| {op} | {case} | {ours_cell} | {peer_cells} | {ratios} | {gbs} | {floor} |")
    return "\n".join(lines)


def notes_text(notes) -> str:
    return "\n".join(f"- {k}: {v}" for k, v in notes.items())


def plot_serving(rows, path, title="Mamba-2 serving ops"):
    """PNG: one group of bars per op and case (time, log scale), one bar per implementation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = list(dict.fromkeys((r["op"], r["case"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    times = {(r["op"], r["case"], r["impl"]): r["us"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(groups)), 5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        xs = [g for g, key in enumerate(groups) if times.get((*key, impl))]
        ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in xs], [times[(*groups[x], impl)] for x in xs],
               width, label=impl)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{op.replace('causal_conv1d', 'conv1d').replace('selective_state_update', 'state upd.')}"
                        f"\n{case}" for op, case in groups], rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("us per call (model decode: per token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
