"""Side-by-side benchmark: our cutile op and every installed peer, same inputs, one process.

Peers (each skipped with a note when it is not installed):
  tilegym      tilegym's own cuTile op, reachable under backend "tilegym-cutile" once we hold "cutile"
  mamba_ssm    mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined (chunk 256)
  fla          fla.ops.simple_gla.chunk_simple_gla (q=c, k=b repeated to all heads, v=x*dt,
               g=a*dt; the repeat and x*dt are prepared outside the timed call and D*x is not
               computed, a head start)
Every output is checked against the float64 chunked reference (first batch element).
Times are medians of many runs after warm-up with the L2 cache flushed before each run.
"""
import json
import math
import platform
import time
from dataclasses import asdict, dataclass

import torch

from ..ssd.reference.forward import chunked_forward_reference
from ..testing import Mamba2ProblemSpec, forward_inputs

ANCHOR_SHAPES = [  # (batch, tokens, groups, heads, state_size, head_size): docs/performance.md's forward rows
    (4, 16384, 1, 8, 128, 64),
    (2, 8192, 1, 80, 128, 64),
    (4, 65536, 1, 8, 128, 64),
    (1, 2048, 1, 32, 128, 64),
    (2, 1024, 2, 8, 128, 64),
]
GRID_SHAPES = ANCHOR_SHAPES + [
    (8, 4096, 1, 32, 64, 128),
    (2, 8192, 8, 64, 256, 64),
]


@dataclass
class Row:
    shape: tuple
    impl: str
    ms: float | None
    rel_err: float | None
    note: str = ""


def floor_bytes(batch, tokens, groups, heads, state, head, elem=2):
    """Fewest bytes: read x, b, c, dt and the initial state once, write y and the final state once."""
    io = batch * tokens * (2 * heads * head + 2 * groups * state + heads) * elem
    return io + 2 * batch * heads * head * state * 4


def nominal_flops(batch, tokens, groups, heads, state, head, chunk=128):
    """C B^T, intra-chunk, carried-state and state-update matmuls at chunk 128: the work a chunked
    scan must do at tilegym's chunk size, whatever chunk a kernel uses."""
    per_chunk = 2 * chunk * chunk * state + 2 * chunk * chunk * head + 4 * chunk * state * head
    return batch * heads * math.ceil(tokens / chunk) * per_chunk


def measure(fn, warmup=25, rep=200):
    """Median milliseconds; the L2 cache is flushed before every run."""
    try:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    except ImportError:
        flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
        times = []
        for i in range(warmup + rep):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); fn(); end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def copy_bandwidth():
    """Device-to-device copy bandwidth in bytes/s (read + write), the floor's yardstick."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (measure(lambda: dst.copy_(src)) * 1e-3)


def peers():
    """name -> fn(inputs) -> out, for each peer that imports."""
    found, notes = {}, {}
    from .. import mamba2_chunk_forward
    found["ours"] = lambda i: mamba2_chunk_forward(**i)[0]
    try:
        import tilegym
        from tilegym.backend.dispatcher import _REGISTRY
        if "tilegym-cutile" in _REGISTRY.get("mamba2_chunk_forward", {}):
            found["tilegym"] = lambda i: tilegym.ops.mamba2_chunk_forward(**i, backend="tilegym-cutile")[0]
        else:
            notes["tilegym"] = "this tilegym has no cuTile mamba2 op of its own"
    except ImportError:
        notes["tilegym"] = "tilegym not installed"
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        found["mamba_ssm"] = lambda i: mamba_chunk_scan_combined(
            i["x"], i["dt"], i["a"], i["b"], i["c"], chunk_size=256, D=i["d"],
            initial_states=i["init_state"], return_final_states=True)[0]
    except Exception as e:  # its package imports a CUDA extension that may be missing
        notes["mamba_ssm"] = f"not importable ({type(e).__name__})"
    try:
        from fla.ops.simple_gla import chunk_simple_gla
        found["fla"] = lambda i: chunk_simple_gla(
            q=i["fla_q"], k=i["fla_k"], v=i["fla_v"], g=i["fla_g"], scale=1.0,
            initial_state=i["fla_h0"], output_final_state=True)[0]
    except Exception as e:
        notes["fla"] = f"not importable ({type(e).__name__})"
    return found, notes


def fla_inputs(i):
    heads = i["x"].shape[2]
    rep = heads // i["b"].shape[2]
    return dict(fla_q=i["c"].repeat_interleave(rep, dim=2).contiguous(),
                fla_k=i["b"].repeat_interleave(rep, dim=2).contiguous(),
                fla_v=(i["x"] * i["dt"][..., None]).to(i["x"].dtype).contiguous(),
                fla_g=(i["a"] * i["dt"].float()).contiguous(),
                fla_h0=i["init_state"].transpose(-1, -2).contiguous())


def run(shapes=ANCHOR_SHAPES, only=None, tilegym_shapes=1, out_json=None, log=print, time_budget_s=None):
    """Benchmarks every implementation on every shape; returns a result dict (also written to
    out_json after each shape, so a run cut short keeps what it measured). tilegym's op autotunes
    150-250 s per new shape, so it runs last, on the first ``tilegym_shapes`` shapes only, and
    only while ``time_budget_s`` (seconds since the start) is not spent."""
    started = time.perf_counter()
    impls, notes = peers()
    if only:
        impls = {k: v for k, v in impls.items() if k in only or k == "ours"}
    bandwidth = copy_bandwidth()
    result = dict(meta=_meta(bandwidth, notes), rows=[])
    tilegym = impls.pop("tilegym", None)
    passes = [(shapes, impls)]
    if tilegym is not None:
        passes.append(([s for s in shapes[:tilegym_shapes] if s[1] % 128 == 0], {"tilegym": tilegym}))
    for pass_shapes, pass_impls in passes:
        for shape in pass_shapes:
            if "tilegym" in pass_impls and time_budget_s and time.perf_counter() - started > time_budget_s:
                notes["tilegym"] = "skipped: time budget spent"
                break
            _bench_shape(shape, pass_impls, bandwidth, result, log)
            if out_json:
                with open(out_json, "w") as f:
                    json.dump(result, f, indent=1)
    return result


def _bench_shape(shape, impls, bandwidth, result, log):
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    first_batch = {k: (v[:1] if k not in ("a", "d", "chunk_size") else v) for k, v in inputs.items()}
    ref, _ = chunked_forward_reference(**first_batch)
    no_skip = ref - inputs["d"][:, None] * inputs["x"][:1].double()  # FLA computes no D*x
    extra = fla_inputs(inputs) if "fla" in impls else {}
    for name, fn in impls.items():
        args = {**inputs, **extra} if name == "fla" else inputs
        try:
            start = time.perf_counter()
            out = fn(args)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            target = no_skip if name == "fla" else ref
            err = ((out[:1].double() - target).norm() / target.norm()).item()
            ms = measure(lambda: fn(args))
            row = Row(shape, name, ms, err, f"first call {first:.1f} s")
        except Exception as e:
            row = Row(shape, name, None, None, f"failed: {type(e).__name__}: {str(e)[:200]}")
        result["rows"].append(asdict(row))
        log(_format(row, shape, bandwidth))
    torch.cuda.empty_cache()


def stage_times(shapes, log=print):
    """Our op stage by stage (median ms each, L2 flushed), next to the whole call: where the
    time goes, and how much of the call is host work between launches."""
    import importlib
    from ..core.validation import check_forward_args, values
    from ..runtime.limits import CUTILE as CUTILE_LIMITS
    from ..ssd.forward import config_for
    stages = {n: importlib.import_module(f"tilegym_mamba2.ssd.{n}")
              for n in ("chunk_cumsum", "fwd_pass_state", "compute_out")}
    from .. import mamba2_chunk_forward
    rows = []
    for shape in shapes:
        spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
        inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
        args = check_forward_args(**inputs, limits=CUTILE_LIMITS)
        x, a, b, c, d, dt, init = args.x, args.a, args.b, args.c, args.d, args.dt, args.init_state
        config = config_for(*values(args))
        chunk = config.chunk_size
        dt_bht, g = stages["chunk_cumsum"].chunk_cumsum(dt, a, chunk)
        entry, final = stages["fwd_pass_state"].fwd_pass_state(x, b, dt_bht, g, init, chunk, config)
        times = dict(
            chunk_cumsum=measure(lambda: stages["chunk_cumsum"].chunk_cumsum(dt, a, chunk)),
            fwd_pass_state=measure(lambda: stages["fwd_pass_state"].fwd_pass_state(x, b, dt_bht, g, init, chunk,
                                                                                   config)),
            compute_out=measure(lambda: stages["compute_out"].compute_out(x, b, c, d, dt_bht, g, entry, final,
                                                                          chunk, config)),
            whole_call=measure(lambda: mamba2_chunk_forward(**inputs)))
        rows.append(dict(shape=shape, config=asdict(config), ms=times))
        log(f"{str(shape):34s} " + "  ".join(f"{k} {v:.3f}" for k, v in times.items())
            + f"  (stages sum {sum(v for k, v in times.items() if k != 'whole_call'):.3f} ms) {config}")
    return rows


def _format(row, shape, bandwidth):
    if row.ms is None:
        return f"{str(shape):34s} {row.impl:10s} {row.note}"
    gbs = floor_bytes(*shape) / (row.ms * 1e-3) / 1e9
    tflops = nominal_flops(*shape) / (row.ms * 1e-3) / 1e12
    floor_ms = floor_bytes(*shape) / bandwidth * 1e3
    return (f"{str(shape):34s} {row.impl:10s} {row.ms:8.3f} ms  {gbs:7.0f} GB/s  {tflops:6.1f} TFLOP/s  "
            f"{row.ms / floor_ms:5.1f}x floor  err {row.rel_err:.1e}  ({row.note})")


def _meta(bandwidth, notes):
    import cuda.tile as ct
    versions = {"torch": torch.__version__, "cuda.tile": getattr(ct, "__version__", "?")}
    for mod in ("tilegym", "triton", "mamba_ssm", "fla"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            pass
    return dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), versions=versions,
                copy_bandwidth_bytes_per_s=bandwidth, host=platform.node(), skipped_peers=notes)


def table(result) -> str:
    """Markdown table: time per implementation and our ratio to each peer and to the floor."""
    bandwidth = result["meta"]["copy_bandwidth_bytes_per_s"]
    by_shape = {}
    for r in result["rows"]:
        by_shape.setdefault(tuple(r["shape"]), {})[r["impl"]] = r["ms"]
    impls = [i for i in ("ours", "tilegym", "mamba_ssm", "fla") if any(i in v for v in by_shape.values())]
    lines = ["| B, T, G, H, N, P | " + " | ".join(f"{i} ms" for i in impls) + " | floor ms | "
             + " | ".join(f"{i} / ours" for i in impls[1:]) + " | ours / floor |",
             "|" + " --- |" * (2 * len(impls) + 2)]
    for shape, times in by_shape.items():
        ours = times.get("ours")
        floor_ms = floor_bytes(*shape) / bandwidth * 1e3
        cells = [f"{times[i]:.3f}" if times.get(i) else "—" for i in impls]
        ratios = [f"{times[i] / ours:.2f}x" if times.get(i) and ours else "—" for i in impls[1:]]
        lines.append(f"| {', '.join(map(str, shape))} | " + " | ".join(cells) + f" | {floor_ms:.3f} | "
                     + " | ".join(ratios) + f" | {ours / floor_ms:.1f}x |" if ours else "| — |")
    return "\n".join(lines)


def plot(result, path):
    """PNG: time against tokens, one line per implementation (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in ("ours", "tilegym", "mamba_ssm", "fla"):
        pts = sorted((r["shape"][1] * r["shape"][0], r["ms"]) for r in result["rows"]
                     if r["impl"] == impl and r["ms"])
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log"); ax.set_yscale("log")
    ax.set_xlabel("batch x tokens"); ax.set_ylabel("median ms")
    ax.set_title(f"Mamba-2 chunked forward, {result['meta']['gpu']}")
    ax.legend(); fig.tight_layout(); fig.savefig(path, dpi=120)
