"""The serving ops side by side with their peers, one case at a time: inputs in HF's call form,
the peers (mamba_ssm's Triton kernel, causal_conv1d's extension, HF's torch steps), a check of
every output against the pytorch backend, then the timing; and the report (table, plot).
``serving.py`` runs these cases and the HF model.
"""
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..testing import relative_error

TOLERANCE = 2e-2        # relative error above which an op's result is flagged ("!") in the table


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


STATE_CASES = ([ServingCase("selective_state_update", b) for b in (1, 8, 64, 256)]
               + [ServingCase("selective_state_update", 64, indices=True)]
               + [ServingCase("selective_state_update", b, graph=True) for b in (1, 64, 256)])
CONV_CASES = [ServingCase("causal_conv1d_fn", 1, seqlen=s) for s in (2048, 8192)]
CONV_UPDATE_CASES = [ServingCase("causal_conv1d_update", b) for b in (1, 64, 256)]
OP_CASES = STATE_CASES + CONV_CASES + CONV_UPDATE_CASES

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
            errors = [relative_error(out, ref_out)] + ([relative_error(mine[inplace], ref_args[inplace])] if inplace else [])
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
        rows[0]["rel_err_vs"] = {k: relative_error(outs["ours"], v) for k, v in outs.items() if k != "ours"}
        if emit:
            emit(None)
    return rows


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
