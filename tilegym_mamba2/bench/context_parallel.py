"""``python -m tilegym_mamba2 bench --context-parallel``: one long sequence split along its
tokens over the ranks, forward and forward + backward, next to the single-GPU op.

Under torchrun (one process per GPU, NCCL) it times the context-parallel op at the launched
world size; rank 0 also times the single-GPU op on the whole sequence when it fits. Without
torchrun it runs the same-GPU form: two processes sharing one GPU over gloo (the summaries
go through host memory), which checks the path and its overhead, not scaling. On a machine
without a GPU: two CPU processes on the pytorch backend at a small size.

Each rank's time is the median of fixed-count runs after warm-up (every rank runs the same
count: each run holds collectives), L2 flushed before each on a GPU. Communicated bytes per
rank are the all-gathers' receive volumes: (ranks - 1) summaries forward, twice that backward.
"""
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

LAYER_2_7B = dict(heads=80, head_size=64, state=128, groups=1, chunk_size=256)


def inputs(tokens, device, dtype, heads, head_size, state, groups, seed=0, **_):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
    return dict(x=randn(1, tokens, heads, head_size), dt=randn(1, tokens, heads, scale=0.5),
                A=-torch.rand(heads, generator=g).to(device) - 0.5, B=randn(1, tokens, groups, state, scale=0.3),
                C=randn(1, tokens, groups, state, scale=0.3), D=torch.ones(heads, device=device),
                dt_bias=torch.zeros(heads, device=device))


def timed(fn, device, warmup=3, rep=10):
    """Median ms of ``rep`` runs after ``warmup`` (the same counts on every rank)."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device) if device.type == "cuda" else None
    times = []
    for i in range(warmup + rep):
        if flush is not None:
            flush.zero_()
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def summary_bytes(shape, elem=4):
    return (shape["heads"] * shape["head_size"] * shape["state"] + shape["heads"]) * elem


def measure_rank(tokens, device, dtype, backend, shape, warmup, rep, single=True):
    """This rank's forward and forward+backward ms on its slice (and rank 0's single-GPU times)."""
    from .. import mamba_chunk_scan_combined
    from ..distributed import context_parallel_scan_combined
    rank, world = dist.get_rank(), dist.get_world_size()
    cuts = [tokens * r // world for r in range(world + 1)]
    full = inputs(tokens, device, dtype, **shape)
    mine = {k: (v[:, cuts[rank]:cuts[rank + 1]].contiguous() if v.ndim > 1 else v) for k, v in full.items()}
    kwargs = dict(chunk_size=shape["chunk_size"], dt_softplus=True, return_final_states=True, backend=backend)
    forward_ms, train_ms = _forward_and_training_ms(context_parallel_scan_combined, mine, kwargs, device, warmup, rep)
    row = {"rank": rank, "ranks": world, "tokens": tokens, "slice": cuts[rank + 1] - cuts[rank],
           "forward_ms": forward_ms, "train_ms": train_ms,
           "bytes_forward": (world - 1) * summary_bytes(shape), "bytes_backward": 2 * (world - 1) * summary_bytes(shape)}
    dist.barrier()
    if single and rank == 0:
        try:
            row["single_forward_ms"], row["single_train_ms"] = _forward_and_training_ms(
                mamba_chunk_scan_combined, full, kwargs, device, warmup, rep)
        except torch.cuda.OutOfMemoryError:
            row["single_note"] = "the whole sequence does not fit on one GPU"
    dist.barrier()
    return row


def _forward_and_training_ms(op, tensors, kwargs, device, warmup, rep):
    """(forward ms without autograd, forward + backward ms with the loss on out alone) of
    op(**tensors, **kwargs)."""
    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}

    def forward():
        with torch.no_grad():
            op(**tensors, **kwargs)

    def train():  # a training loss on the outputs alone, as most are
        out = op(**leaves, **{**kwargs, "return_final_states": False})
        out.float().sum().backward()
    return timed(forward, device, warmup, rep), timed(train, device, warmup, rep)


def _spawned(rank, world, rendezvous, tokens, on_gpu, shape, warmup, rep, results):
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        row = measure_rank(tokens, device, torch.bfloat16 if on_gpu else torch.float32,
                           "cutile" if on_gpu else "pytorch", shape, warmup, rep)
    except Exception as e:  # the parent stops the other rank and says why
        row = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
    results.put(row)
    if "error" not in row:
        dist.destroy_process_group()


def check_tokens(tokens, ranks):
    """ValueError naming --tokens unless every rank gets at least one token."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < ranks):
        raise ValueError(f"--tokens must be a whole number of at least {ranks} (one token per rank), got {tokens!r}")


def _collect(procs, results, log):
    """Every rank's row, rank 0's first; stops every rank as soon as one fails or dies."""
    import queue
    rows = []
    try:
        while len(rows) < len(procs):
            try:
                row = results.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
                if dead:
                    raise RuntimeError(f"bench --context-parallel: rank {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode}) before reporting") from None
                continue
            if "error" in row:
                raise RuntimeError(f"bench --context-parallel: rank {row['rank']} failed: {row['error']}")
            rows.append(row)
    finally:
        for p in procs:
            p.join(timeout=30 if rows and len(rows) == len(procs) else 1)
            if p.is_alive():
                p.kill()
    return sorted(rows, key=lambda r: r["rank"])


def run_context_parallel_bench(tokens=None, warmup=3, rep=10, out_json="bench_context_parallel.json", log=print):
    """The benchmark in whichever form this machine allows; returns the rows (rank 0's first)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _under_torchrun(tokens or 2 ** 20, warmup, rep, out_json, log)
    check_tokens(tokens, 2)
    on_gpu = torch.cuda.is_available()
    shape = LAYER_2_7B if on_gpu else dict(heads=8, head_size=32, state=32, groups=1, chunk_size=64)
    tokens = tokens or (2 ** 16 if on_gpu else 2 ** 12)
    log("context parallelism, same-machine form: 2 processes over gloo "
        + ("sharing cuda:0 (the path and its overhead; scaling needs torchrun on several GPUs)" if on_gpu else
           "on the CPU, pytorch backend, small shape (timing at scale needs GPUs and torchrun)"))
    import tempfile

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="cp-bench-"), "file")
    procs = [ctx.Process(target=_spawned, args=(r, 2, rendezvous, tokens, on_gpu, shape, warmup, rep, results))
             for r in range(2)]
    for p in procs:
        p.start()
    return _report(_collect(procs, results, log), shape, out_json, log)


def _under_torchrun(tokens, warmup, rep, out_json, log):
    check_tokens(tokens, int(os.environ["WORLD_SIZE"]))
    local = int(os.environ.get("LOCAL_RANK", 0))
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    shape = LAYER_2_7B
    row = measure_rank(tokens, device, torch.bfloat16 if on_gpu else torch.float32, "cutile" if on_gpu else "pytorch",
                       shape, warmup, rep)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    return _report(rows, shape, out_json, log) if row["rank"] == 0 else rows


def _report(rows, shape, out_json, log):
    head = rows[0]
    slowest = {k: max(r[k] for r in rows) for k in ("forward_ms", "train_ms")}
    log(f"{head['tokens']} tokens, batch 1, {shape['heads']} heads x {shape['head_size']} x state {shape['state']}, "
        f"{head['ranks']} ranks")
    log(f"{'':30}{'forward ms':>12}{'tokens/s':>14}{'fwd+bwd ms':>12}{'tokens/s':>14}")
    for name, fwd, train in [(f"context parallel ({head['ranks']})", slowest["forward_ms"], slowest["train_ms"]),
                             ("one process, whole sequence", head.get("single_forward_ms"),
                              head.get("single_train_ms"))]:
        if fwd is None:
            log(f"{name:30}{head.get('single_note', 'not run')}")
            continue
        log(f"{name:30}{fwd:12.2f}{head['tokens'] / fwd * 1e3:14.3g}{train:12.2f}{head['tokens'] / train * 1e3:14.3g}")
    log(f"communicated per rank: {head['bytes_forward'] / 1e6:.2f} MB forward, {head['bytes_backward'] / 1e6:.2f} MB "
        f"backward (independent of the tokens)")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"shape": shape, "rows": rows}, f, indent=1)
    return rows
