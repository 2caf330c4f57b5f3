"""Training speed: forward + backward of the plain op, ours and the peers on the same inputs in
one process. ``python -m tilegym_mamba2 bench --backward``.

    ours        mamba2_chunk_forward then mamba2_chunk_backward (cutile), and the same through
                autograd (the custom op: what a model's loss.backward() runs)
    tilegym     tilegym 1.5.1's own cuTile forward and backward (backend "tilegym-cutile"; they
                autotune for minutes per new shape, so they run on ``tilegym_shapes`` shapes)
    mamba_ssm   its autograd mamba_chunk_scan_combined (chunk 256), forward + backward

Every implementation's gradients are checked against float64 autograd of the chunked reference
on the first batch row. Times: medians with the L2 cache flushed (bench.measure).
"""
import time

import torch

from ..ssd.reference.forward import chunked_forward_reference
from ..testing import Mamba2ProblemSpec, forward_inputs
from .forward import ANCHOR_SHAPES, floor_bytes, measure

NAMES = ("dx", "da", "db", "dc", "dd", "ddt", "dinit_state")


def implementations():
    """name -> fn(inputs, dout, dfinal) -> the seven gradients; notes for the missing ones."""
    import tilegym_mamba2
    found, notes = {}, {}

    def ours(i, dout, dfinal):
        tilegym_mamba2.mamba2_chunk_forward(**i)
        return tilegym_mamba2.mamba2_chunk_backward(**i, dout=dout, dfinal_state=dfinal)

    found["ours"] = ours
    found["ours autograd"] = lambda i, dout, dfinal: _autograd(tilegym_mamba2.mamba2_chunk_forward, i, dout, dfinal)
    try:
        import tilegym
        from tilegym.backend.dispatcher import _REGISTRY
        if "tilegym-cutile" in _REGISTRY.get("mamba2_chunk_backward", {}):
            def theirs(i, dout, dfinal):
                tilegym.ops.mamba2_chunk_forward(**i, backend="tilegym-cutile")
                return tilegym.ops.mamba2_chunk_backward(**i, dout=dout, dfinal_state=dfinal,
                                                         backend="tilegym-cutile")
            found["tilegym"] = theirs
        else:
            notes["tilegym"] = "this tilegym has no cuTile mamba2 backward of its own"
    except ImportError:
        notes["tilegym"] = "tilegym not installed"
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        def mamba_ssm(i, dout, dfinal):
            def forward(x, a, b, c, d, dt, init_state, chunk_size):
                return mamba_chunk_scan_combined(x, dt, a, b, c, chunk_size=256, D=d, initial_states=init_state,
                                                 return_final_states=True)
            return _autograd(forward, i, dout, dfinal)
        found["mamba_ssm"] = mamba_ssm
    except Exception as e:  # its package imports a CUDA extension that may be missing
        notes["mamba_ssm"] = f"not importable ({type(e).__name__})"
    return found, notes


def _first_forward(inputs) -> float:
    """Seconds of the forward's first call alone (its compiles and tuning), so that the backward's
    first call (the issue's "under 10 s") shows apart from it."""
    import tilegym_mamba2
    start = time.perf_counter()
    tilegym_mamba2.mamba2_chunk_forward(**inputs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _autograd(forward, inputs, dout, dfinal):
    leaves = {k: (v.detach().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    out, final = forward(**leaves)
    torch.autograd.backward([out, final], [dout, dfinal])
    return tuple(leaves[k].grad for k in ("x", "a", "b", "c", "d", "dt", "init_state"))


def _reference(inputs, dout, dfinal):
    first = {k: (v[:1] if k not in ("a", "d", "chunk_size") else v) for k, v in inputs.items()}
    leaves = [first[k].double().requires_grad_() for k in ("x", "a", "b", "c", "d", "dt", "init_state")]
    out, final = chunked_forward_reference(*leaves, chunk_size=64)
    loss = (out * dout[:1].double()).sum() + (final * dfinal[:1].double()).sum()
    return torch.autograd.grad(loss, leaves)


def _max_error(grads, refs):
    """Worst ‖g − ref‖/‖ref‖ over the first row's gradients (da and dd sum over every row, so
    they are left to the tests, which check them on their own)."""
    worst = 0.0
    for name, got, ref in zip(NAMES, grads, refs):
        if name in ("da", "dd"):
            continue
        got = got[:1].double()
        if torch.isnan(got).any():
            return float("nan")
        worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    return worst


def run_backward_bench(shapes=ANCHOR_SHAPES[:2], tilegym_shapes=2, only=None, log=print):
    """only: the peers to time (names in implementations()), all of them when None; ours always."""
    impls, notes = implementations()
    if only is not None:
        impls = {name: fn for name, fn in impls.items() if name.startswith("ours") or name in only}
    for name, note in notes.items():
        log(f"{name}: skipped, {note}")
    rows = []
    for index, shape in enumerate(shapes):
        spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, device="cuda")
        inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
        gen = torch.Generator(device="cuda").manual_seed(1)
        dout = torch.randn(inputs["x"].shape, generator=gen, device="cuda").to(inputs["x"].dtype)
        dfinal = torch.randn(inputs["init_state"].shape, generator=gen, device="cuda")
        refs = _reference(inputs, dout, dfinal)
        floor_ms = 2 * floor_bytes(*shape) / 4.3e12 * 1e3  # read and write about twice the forward's bytes
        for name, fn in impls.items():
            if name == "tilegym" and index >= tilegym_shapes:
                continue
            try:
                start = time.perf_counter()
                first_forward = _first_forward(inputs) if name == "ours" else None
                grads = fn(inputs, dout, dfinal)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                err = _max_error(grads, refs)
                del grads
                ms = measure(lambda: fn(inputs, dout, dfinal))
                row = dict(shape=shape, impl=name, ms=ms, max_rel_err=err, first_call_s=first, floor_ms=floor_ms)
                parts = ""
                if first_forward is not None:
                    row.update(first_forward_s=first_forward, first_backward_s=first - first_forward)
                    parts = f" (forward {first_forward:.1f}, backward {first - first_forward:.1f})"
                log(f"{str(shape):32s} {name:14s} fwd+bwd {ms:8.3f} ms  max grad err {err:.1e}  "
                    f"first call {first:.1f} s{parts}  (floor {floor_ms:.3f} ms)")
            except Exception as e:
                row = dict(shape=shape, impl=name, ms=None, note=f"failed: {type(e).__name__}: {str(e)[:200]}")
                log(f"{str(shape):32s} {name:14s} {row['note']}")
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def backward_table(rows) -> str:
    by_shape = {}
    for r in rows:
        by_shape.setdefault(tuple(r["shape"]), {})[r["impl"]] = r.get("ms")
    lines = ["| B, T, G, H, N, P | ours | ours (autograd) | tilegym | mamba_ssm | tilegym / ours | mamba_ssm / ours |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for shape, t in by_shape.items():
        def cell(name):
            return f"{t[name]:.3f}" if t.get(name) else "—"
        def ratio(name):
            return f"{t[name] / t['ours']:.2f}x" if t.get(name) and t.get("ours") else "—"
        lines.append(f"| {', '.join(map(str, shape))} | {cell('ours')} | {cell('ours autograd')} | {cell('tilegym')} "
                     f"| {cell('mamba_ssm')} | {ratio('tilegym')} | {ratio('mamba_ssm')} |")
    return "\n".join(lines)
