"""After a training step's first call, the kernels of the other token-count class compile in the
background (runtime/other_token_class.py): the first step of the other class compiles nothing
itself, and its gradients are right. In a fresh process (its own in-memory kernel cache), under a
hard timeout."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = r'''
import json, sys, threading, torch
import cuda.tile._compile as tile_compile
import tilegym_mamba2 as tm
from tilegym_mamba2.runtime import other_token_class as other

# Every compile this process's main thread runs, ours or not (cuTile imports compile_tile at call time).
main_thread_compiles = [0]
_compile_tile = tile_compile.compile_tile
def counted(*args, **kwargs):
    main_thread_compiles[0] += threading.current_thread() is threading.main_thread()
    return _compile_tile(*args, **kwargs)
tile_compile.compile_tile = counted

def leaves(tokens, batch, dtype):
    """Random bf16-rounded inputs in ``dtype`` (bf16 for ours, float64 for the reference)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    heads, head, state = 6, 64, 64
    def draw(*shape, scale=0.5, shift=0.0, low=True):
        t = torch.randn(*shape, generator=g, device="cuda") * scale + shift
        t = t.bfloat16() if low else t
        return t.to(dtype if low else torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    return dict(x=draw(batch, tokens, heads, head), z=draw(batch, tokens, heads, head, scale=1.0),
                b=draw(batch, tokens, 1, state), c=draw(batch, tokens, 1, state),
                dt=draw(batch, tokens, heads, scale=1.0, shift=-2.0, low=False),
                a=(-torch.linspace(1, 8, heads, device="cuda")).to(torch.float64 if dtype == torch.float64
                                                                    else torch.float32).requires_grad_(),
                d=draw(heads, scale=1.0, low=False))

def layer_step(tokens, backend, dtype):
    t = leaves(tokens, 1, dtype)
    out = tm.mamba_chunk_scan_combined(t["x"], t["dt"], t["a"], t["b"], t["c"], 128, D=t["d"], z=t["z"],
                                       dt_softplus=True, backend=backend)
    out.float().square().sum().backward()
    return [out] + [t[k].grad for k in ("x", "z", "b", "c", "dt", "a", "d")]

def plain_step(tokens, backend, dtype):
    t = leaves(tokens, 2, dtype)
    dt = torch.nn.functional.softplus(t["dt"].detach()).requires_grad_()
    out, final = tm.mamba2_chunk_forward(t["x"], t["a"], t["b"], t["c"], t["d"], dt, None, 128, backend=backend)
    out.float().square().sum().backward()
    return [out] + [t[k].grad for k in ("x", "b", "c", "a", "d")] + [dt.grad]

report = {}
for name, step, first, then in (("layer", layer_step, 256, 255), ("plain", plain_step, 200, 208)):
    step(first, "cutile", torch.bfloat16)
    torch.cuda.synchronize()
    idle = other.wait_idle(300)
    before, compiles_before = dict(other.stats), main_thread_compiles[0]
    ours = step(then, "cutile", torch.bfloat16)
    torch.cuda.synchronize()
    delta = {k: other.stats[k] - before[k] for k in before}
    delta["main_thread_compiles"] = main_thread_compiles[0] - compiles_before
    exact = step(then, "pytorch", torch.float64)
    errors = [((o.double() - e).norm() / e.norm()).item() for o, e in zip(ours, exact)]
    report[name] = {"idle": idle, "delta": delta, "errors": errors, "replays_failed": other.stats["replays_failed"]}
print("REPORT " + json.dumps(report))
'''


def test_the_other_token_class_compiles_in_the_background():
    env = dict(os.environ, TILEGYM_MAMBA2_PRECOMPILE="1")
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=480)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"the script did not end in {timeout.timeout} s (a compile or the background thread "
                    f"still running); its output so far:\n{timeout.stdout}\n{timeout.stderr}")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    for op, result in report.items():
        assert result["replays_failed"] == 0, f"{op}: a replay raised on meta tensors: {result}"
        assert result["idle"], f"{op}: the background compiles did not end in 300 s"
        assert result["delta"]["main_thread_compiles"] == 0, f"{op}: the other class's step compiled itself: {result}"
        assert result["delta"]["taken"] > 0, f"{op}: nothing was taken from the background: {result}"
        assert all(e < 2e-2 for e in result["errors"]), f"{op}: the other class's step is off float64: {result}"
