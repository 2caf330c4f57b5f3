"""The layer op side by side: ``mamba_chunk_scan_combined`` as Mamba-2 mixers call it, ours and
mamba_ssm's (when installed) on the same inputs in one process, each checked against the
float64 chunked reference. ``python -m tilegym_mamba2 bench --layer``; with ``--backward``, a
training step instead: the forward and, through autograd, the gradients of every input for a
loss of the output alone (what a model's loss.backward() runs), ours returning varlen states as
in the forward cases, mamba_ssm without them (its backward refuses them).

Cases: raw dt with dt_bias and softplus and D per head (mamba_ssm's Mamba2 defaults), and z gating
in the scan (as Mamba2 calls it with rmsnorm=False; with its default gated norm z goes to the norm
and the scan gets none), on whole rows and on packed batches (cu_seqlens and seq_idx, varlen
states returned).
"""
import time
from dataclasses import dataclass

import torch

from ..ssd.dt import process_dt
from ..ssd.reference.layer import chunked_layer_reference
from .forward import measure


@dataclass(frozen=True)
class LayerCase:
    name: str
    rows: int
    tokens: int
    groups: int
    heads: int
    state_size: int
    head_size: int
    sequences: int = 1    # > 1: that many random-length sequences packed in batch 1
    own_initial_states: bool = False  # each packed sequence starts from an initial state of its own


LAYER_CASES = [
    LayerCase("2.7B layer, 2 rows", 2, 8192, 1, 80, 128, 64),
    LayerCase("source config, 4 rows", 4, 16384, 1, 8, 128, 64),
    LayerCase("64 packed sequences in 65536 tokens (32 heads)", 1, 65536, 1, 32, 128, 64, sequences=64),
    LayerCase("8 packed sequences in 4096 tokens (32 heads)", 1, 4096, 1, 32, 128, 64, sequences=8),
]
# The cost of packing: 4096 one-token sequences against one sequence of the same 4096 tokens
# (their ratio is what packing costs, the same tokens either way).
PACKED_COST_CASES = [
    LayerCase("one 4096-token sequence (32 heads)", 1, 4096, 1, 32, 128, 64),
    LayerCase("4096 one-token sequences (32 heads)", 1, 4096, 1, 32, 128, 64, sequences=4096),
    LayerCase("4096 one-token sequences, own initial states", 1, 4096, 1, 32, 128, 64, sequences=4096,
              own_initial_states=True),
]
LAYER_CASES += PACKED_COST_CASES


def layer_inputs(case: LayerCase, device="cuda", dtype=torch.bfloat16, seed=0):
    """-> (arguments of mamba_chunk_scan_combined without chunk_size, sequence lengths)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(shape, generator=gen).to(device, dt)

    heads, rows, tokens = case.heads, case.rows, case.tokens
    args = dict(x=randn(rows, tokens, heads, case.head_size), dt=randn(rows, tokens, heads) * 0.5 - 2.0,
                A=-torch.exp(torch.empty(heads).uniform_(0.0, 2.77, generator=gen)).to(device),
                B=randn(rows, tokens, case.groups, case.state_size), C=randn(rows, tokens, case.groups, case.state_size),
                D=randn(heads, dt=torch.float32), z=randn(rows, tokens, heads, case.head_size),
                dt_bias=_inverse_softplus(torch.exp(torch.empty(heads).uniform_(-6.9, -2.3, generator=gen))).to(device),
                dt_softplus=True)
    lengths = [tokens]
    if case.sequences > 1:
        cuts = torch.randperm(tokens - 1, generator=gen)[:case.sequences - 1].add(1).sort().values.tolist()
        offsets = [0] + cuts + [tokens]
        lengths = [e - s for s, e in zip(offsets, offsets[1:])]
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=device, dtype=torch.int32),
                                          torch.tensor(lengths, device=device))[None]
        args.update(cu_seqlens=cu_seqlens, seq_idx=seq_idx, return_varlen_states=True)
        if case.own_initial_states:
            args["initial_states"] = randn(len(lengths), heads, case.head_size, case.state_size, dt=torch.float32)
    return args, lengths


def _inverse_softplus(dt0):
    # Mamba-2's dt_bias initialisation: softplus(dt_bias) = dt0, log-uniform in [1e-3, 1e-1].
    return dt0 + torch.log(-torch.expm1(-dt0))


TRAINED = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")   # the layer op's differentiable inputs


def implementations(training=False):
    """name -> fn(args, chunk_size) -> out; notes for the ones that are missing. ``training``: fn
    also runs the backward of out · dout (args then hold leaves that require grad, and dout)."""
    import tilegym_mamba2
    found = {"ours": lambda a, chunk: tilegym_mamba2.mamba_chunk_scan_combined(**a, chunk_size=chunk,
                                                                              backend="cutile")}
    notes = {}
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        def mamba_ssm(a, chunk):
            if training:
                a = {k: v for k, v in a.items() if k != "return_varlen_states"}
            return mamba_chunk_scan_combined(**a, chunk_size=chunk)
        found["mamba_ssm"] = mamba_ssm
    except Exception as e:  # its package imports a CUDA extension that may be missing
        notes["mamba_ssm"] = f"not importable ({type(e).__name__})"
    if training:
        return {name: _training_step(fn) for name, fn in found.items()}, notes
    return {name: (lambda a, chunk, fn=fn: _out(fn(a, chunk))) for name, fn in found.items()}, notes


def _training_step(call):
    def step(args, chunk):
        args = dict(args)
        dout = args.pop("dout")
        out = _out(call(args, chunk))
        torch.autograd.grad(out, [args[k] for k in TRAINED], dout)
        return out.detach()
    return step


def training_args(args, seed=1):
    """The forward case's arguments as leaves that require grad, and a fixed dout."""
    leaves = {k: (v.detach().clone().requires_grad_() if k in TRAINED else v) for k, v in args.items()}
    gen = torch.Generator(device=args["x"].device).manual_seed(seed)
    leaves["dout"] = torch.randn(args["x"].shape, generator=gen, device=args["x"].device).to(args["x"].dtype)
    return leaves


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def run_layer_bench(cases=LAYER_CASES, chunk_size=256, peers=True, log=print, training=False):
    """peers=False: ours alone. training: forward + backward (implementations)."""
    impls, notes = implementations(training)
    if not peers:
        impls, notes = {"ours": impls["ours"]}, {}
    for name, note in notes.items():
        log(f"{name}: skipped, {note}")
    rows = []
    for case in cases:
        args, lengths = layer_inputs(case)
        ref = _reference(args, chunk_size)
        if training:
            args = training_args(args)
        for name, fn in impls.items():
            start = time.perf_counter()
            try:
                out = fn(args, chunk_size)
            except Exception as e:  # a peer without this option (per-sequence initial states, say)
                log(f"{case.name:32s} {name:10s} skipped: {type(e).__name__}: {str(e)[:120]}")
                continue
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            got = out[:1].double()
            err = ((got - ref).norm() / ref.norm()).item() if not torch.isnan(got).any() else float("nan")
            ms = measure(lambda: fn(args, chunk_size))
            rows.append(dict(case=case.name, impl=name, ms=ms, rel_err=err, first_call_s=first,
                             mode="forward + backward" if training else "forward"))
            log(f"{case.name:32s} {name:10s} {'fwd+bwd ' if training else ''}{ms:8.3f} ms  err {err:.1e}  "
                f"first call {first:.1f} s"
                + (f"  ({len(lengths)} sequences)" if len(lengths) > 1 else ""))
        torch.cuda.empty_cache()
    return rows


def _reference(args, chunk_size):
    """float64 chunked reference for the first row (exact against the layer's definition)."""
    first = {k: (v.detach()[:1] if isinstance(v, torch.Tensor) and k in ("x", "dt", "B", "C", "z", "seq_idx")
                 else v) for k, v in args.items()}
    dt = process_dt(first["dt"], first["dt_bias"], True, dtype=torch.float64)
    out, _, _ = chunked_layer_reference(first["x"], dt, first["A"], first["B"], first["C"], D=first["D"],
                                        z=first["z"], initial_states=first.get("initial_states"),
                                        seq_idx=first.get("seq_idx"),
                                        cu_seqlens=first.get("cu_seqlens"), chunk_size=64)
    return out


def layer_table(rows) -> str:
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["impl"]] = r["ms"]
    lines = ["| case | ours ms | mamba_ssm ms | mamba_ssm / ours |", "| --- | --- | --- | --- |"]
    for case, times in by_case.items():
        ours, theirs = times.get("ours"), times.get("mamba_ssm", times.get("mamba_ssm pieces"))
        ratio = f"{theirs / ours:.2f}x" if ours and theirs else "—"
        lines.append(f"| {case} | {ours:.3f} | " + (f"{theirs:.3f}" if theirs else "—") + f" | {ratio} |")
    return "\n".join(lines)
