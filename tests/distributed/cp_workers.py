"""Spawned ranks for the context-parallel tests: each builds the same global inputs from a seed,
runs the single-process op on the whole sequence and the context-parallel op on its slice, and
reports the largest differences (outputs, final states, every gradient) to the parent."""
import faulthandler
import functools
import os
import traceback
import zlib

import torch
import torch.distributed as dist

F64 = torch.float64


CASE_TIMEOUT_S = 60      # a case that takes longer on some rank is a hang
STARTUP_TIMEOUT_S = 240  # starting a rank (torch and the package imported) on a busy 2-core machine


def assert_no_rank_crashed(per_rank, case):
    """Names every rank that crashed in ``case``, each with its error: a rank that fails leaves
    the others waiting for it, so the first rank's error alone often names the wait, not the cause."""
    crashed = {rank: results[case]["crash"] for rank, results in enumerate(per_rank) if "crash" in results[case]}
    assert not crashed, "\n".join(f"rank {rank} {case}:\n{text}" for rank, text in crashed.items())


def run_ranks(world, cases, *args, case_timeout=CASE_TIMEOUT_S, env=None):
    """Runs ``cases(rank, world, *args)`` -- a dict {case name: callable()} -- in ``world``
    spawned processes over gloo, the cases one after another in every rank -> per rank, {case:
    what its callable returned}. Every case runs under a hard timeout: when some rank has not
    finished a case ``case_timeout`` s after the last rank started it, every rank is killed and
    an AssertionError names the case and the ranks still in it. ``env``: variables set in the ranks."""
    import queue
    import tempfile
    import time

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    messages, release = ctx.Queue(), ctx.Event()
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="cp-rdv-"), "file")
    procs = [ctx.Process(target=_rank_main, args=(rank, world, rendezvous, messages, release, env or {}, cases, args,
                                                              case_timeout))
             for rank in range(world)]
    for p in procs:
        p.start()
    done, results, started = {r: set() for r in range(world)}, {r: {} for r in range(world)}, {}
    current = {r: "(starting)" for r in range(world)}   # what each rank is doing now
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while any(current[r] is not None for r in range(world)):
            try:
                rank, kind, case, value = messages.get(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                dead = _dead_rank(procs, current)
                if dead is not None:   # a rank that died cannot report: say so at once
                    raise AssertionError(f"rank {dead} exited with code {procs[dead].exitcode} while in "
                                         f"{current[dead]}") from None
                if time.monotonic() < deadline:
                    continue
                stuck = sorted(r for r in range(world) if current[r] is not None)
                waiting = {r: current[r] for r in stuck}
                raise AssertionError(f"hang: {world} ranks, ranks {stuck} still waiting ({waiting}) "
                                     f"after the case's {case_timeout} s") from None
            if kind == "start":
                current[rank] = case
                started.setdefault(case, set()).add(rank)
                if len(started[case]) == world:   # the case's clock starts when every rank is in it
                    deadline = time.monotonic() + case_timeout
            elif kind == "done":
                results[rank][case] = value
                done[rank].add(case)
                current[rank] = None if case == _END else "(between cases)"
                if all(case in done[r] for r in range(world)) and case != _END:
                    deadline = time.monotonic() + case_timeout
            elif kind == "crash":
                # A rank that died makes its peers crash (gloo: "connection closed by peer"), and their
                # report can come before the parent sees the death: name the death first.
                dead = _dead_rank(procs, current, wait_s=2.0)
                cause = "" if dead is None else (f"rank {dead} exited with code {procs[dead].exitcode} while in "
                                                 f"{current[dead]}; then ")
                raise AssertionError(f"{cause}rank {rank} crashed outside any case:\n{value}")
    finally:
        release.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [{k: v for k, v in results[r].items() if k != _END} for r in range(world)]


_END = "(end)"


def _dead_rank(procs, current, wait_s=0.0):
    """A rank whose process ended while it still had work (ranks leave only when released), or
    None; waits up to ``wait_s`` seconds for one."""
    import time
    deadline = time.monotonic() + wait_s
    while True:
        dead = [r for r, p in enumerate(procs) if current[r] is not None and p.exitcode is not None]
        if dead or time.monotonic() >= deadline:
            return dead[0] if dead else None
        time.sleep(0.05)


def _rank_main(rank, world, rendezvous, messages, release, env, cases, args, case_timeout):
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        for name, call in cases(rank, world, *args).items():
            messages.put((rank, "start", name, None))
            # a rank still in the case near its timeout prints where it waits (to the test's stderr)
            faulthandler.dump_traceback_later(max(1.0, case_timeout - 2), exit=False)
            value = _guarded(call)
            faulthandler.cancel_dump_traceback_later()
            messages.put((rank, "done", name, value))
        messages.put((rank, "done", _END, None))
    except Exception:
        messages.put((rank, "crash", None, traceback.format_exc()))
    # A group left waiting (a rank timed out in a collective) may not shut down: the parent
    # collects the results, then every rank leaves at once.
    release.wait(STARTUP_TIMEOUT_S)
    messages.close()
    messages.join_thread()
    os._exit(0)


# --- cases ---------------------------------------------------------------------------------

def cuts_for(name, tokens, world):
    """Slice boundaries of each case for ``world`` ranks."""
    if name == "one_token_slices":      # every rank but the last holds one token
        return list(range(world)) + [tokens]
    if name == "unequal":
        lengths = [3 + 5 * r for r in range(world)]
        lengths[-1] = tokens - sum(lengths[:-1])
        return [sum(lengths[:r]) for r in range(world)] + [tokens]
    return [round(tokens * r / world) for r in range(world + 1)]


def scan_cases(world):
    """name -> (tokens, seq_idx rows or None, cu_seqlens or None, options)."""
    all_options = dict(D="head", z=True, dt_bias=True, dt_softplus=True, dt_limit=(0.01, 2.0), initial_states=True)
    cuts = cuts_for("even", 48, world)
    edge = cuts[1]                                       # a boundary exactly at rank 0's end
    cases = {
        "even": (48, None, None, all_options),
        "unequal": (48, None, None, dict(D="channel", initial_states=True)),
        "one_token_slices": (40, None, None, all_options),
        "boundaries": (48, [[0] * 5 + [1] * (edge - 5) + [2] * (48 - edge), [0] * 30 + [1] * 18], None, all_options),
        "span_three_ranks": (48, [[0] * 2 + [1] * 44 + [2] * 2, [0] * 48], None, dict(z=True, initial_states=True)),
        "many_short": (48, [[t // 3 for t in range(48)], [t // 2 for t in range(48)]], None, all_options),
        "cu_seqlens": (48, None, [0, 7, edge, edge + 1, 40, 48], dict(D="head", initial_states="per_sequence")),
        "no_options": (33, None, None, {}),
    }
    return cases


def _inputs(seed, tokens, batch, options, groups=2, heads=4, head_size=8, state=8):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)
    t = dict(x=randn(batch, tokens, heads, head_size), dt=randn(batch, tokens, heads),
             A=-torch.rand(heads, generator=g, dtype=F64) - 0.3,
             B=randn(batch, tokens, groups, state), C=randn(batch, tokens, groups, state))
    if options.get("D") == "head":
        t["D"] = randn(heads)
    elif options.get("D") == "channel":
        t["D"] = randn(heads, head_size)
    if options.get("z"):
        t["z"] = randn(batch, tokens, heads, head_size)
    if options.get("dt_bias"):
        t["dt_bias"] = randn(heads)
    return t, g


SLICED = ("x", "dt", "B", "C", "z")


def scan_case(rank, world, name, tokens, seq_rows, cu, options, backend="pytorch", dtype=F64, device="cpu",
              chunk_size=16, sizes=None):
    """Differences between the single-process op (whole sequence) and the context-parallel op.
    sizes: _inputs' groups, heads, head_size, state (small ones by default)."""
    import tilegym_mamba2
    from tilegym_mamba2.distributed import context_parallel_scan_combined
    batch = 1 if cu is not None else 2
    t, g = _inputs(zlib.crc32(name.encode()), tokens, batch, options, **(sizes or {}))
    num_seqs = len(cu) - 1 if cu is not None else batch
    if options.get("initial_states"):
        t["initial_states"] = torch.randn(num_seqs if options["initial_states"] == "per_sequence" else batch,
                                          *t["x"].shape[2:], t["B"].shape[-1], generator=g, dtype=F64)
    seq_idx = None if seq_rows is None else torch.tensor(seq_rows, dtype=torch.int32)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    weight_out = torch.randn(batch, tokens, *t["x"].shape[2:], generator=g, dtype=F64)
    weight_final = torch.randn(batch, *t["x"].shape[2:], t["B"].shape[-1], generator=g, dtype=F64)
    kwargs = dict(dt_softplus=options.get("dt_softplus", False), dt_limit=options.get("dt_limit", (0.0, float("inf"))),
                  return_final_states=True)
    params = F64 if dtype == F64 else torch.float32     # A, D, dt_bias, initial_states
    t = {k: v.to(device=device, dtype=dtype if k in SLICED else params) for k, v in t.items()}

    def leaves(part):
        return {k: (v[:, part] if k in SLICED else v).detach().clone().requires_grad_() for k, v in t.items()}

    whole = leaves(slice(None))
    out, final = tilegym_mamba2.mamba_chunk_scan_combined(
        chunk_size=chunk_size, seq_idx=None if seq_idx is None else seq_idx.to(device),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device), backend=backend, **whole, **kwargs)
    ((out.double() * weight_out.to(device)).sum() + (final.double() * weight_final.to(device)).sum()).backward()

    cuts = cuts_for(name, tokens, world)
    part = slice(cuts[rank], cuts[rank + 1])
    mine = leaves(part)
    cp_out, cp_final = context_parallel_scan_combined(
        chunk_size=chunk_size, seq_idx=None if seq_idx is None else seq_idx[:, part].contiguous().to(device),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device), backend=backend, **mine, **kwargs)
    # Each rank's loss takes its slice of the outputs and a 1/world share of the final states.
    ((cp_out.double() * weight_out[:, part].to(device)).sum()
     + (cp_final.double() * weight_final.to(device)).sum() / world).backward()
    return differences(out[:, part], final, whole, cp_out, cp_final, mine, part)


def differences(out, final, whole, cp_out, cp_final, mine, part, sliced=SLICED):
    """{quantity: (largest |difference|, largest |reference|)}; replicated gradients summed over ranks."""
    diffs = {"out": _diff(cp_out, out), "final_states": _diff(cp_final, final)}
    for k, leaf in mine.items():
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        want = whole[k].grad
        if k in sliced:
            want = want[:, part]
        else:
            grad = grad.clone()
            dist.all_reduce(grad)
        diffs[f"d{k}"] = _diff(grad, want)
    return diffs


def _diff(got, want):
    """(largest |difference|, largest |want|, all finite, ||difference|| / ||want||)."""
    diff = got.double() - want.double()
    return (diff.abs().max().item(), want.double().abs().max().item(), bool(torch.isfinite(got).all()),
            (diff.norm() / want.double().norm().clamp_min(1e-30)).item())


MIXER = dict(nheads=4, headdim=8, dstate=8, ngroups=2, width=4, d_nonssm=3, out_dim=12)


def mixer_inputs(g, batch, tokens, nheads, headdim, dstate, ngroups, width, d_nonssm, out_dim):
    """A small mixer's float64 inputs (zxbcdt and every weight) from the generator ``g``."""
    dim = nheads * headdim
    channels = 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=F64) * scale
    return dict(zxbcdt=randn(batch, tokens, channels),
                conv1d_weight=randn(dim + 2 * ngroups * dstate, width, scale=0.5),
                conv1d_bias=randn(dim + 2 * ngroups * dstate), dt_bias=randn(nheads),
                A=-torch.rand(nheads, generator=g, dtype=F64) - 0.3, D=randn(nheads),
                initial_states=randn(batch, nheads, headdim, dstate), rmsnorm_weight=randn(dim),
                outproj_weight=randn(out_dim, dim + d_nonssm, scale=0.2), outproj_bias=randn(out_dim))


def mixer_case(rank, world, name, tokens, seq_rows, backend="pytorch", dtype=F64, device="cpu"):
    """The whole mixer (and its convolution's halo) against mamba_split_conv1d_scan_combined."""
    import tilegym_mamba2
    from tilegym_mamba2.distributed import context_parallel_split_conv1d_scan_combined
    g = torch.Generator().manual_seed(7)
    batch, nheads, headdim, dstate, ngroups, out_dim = 2, *(MIXER[k] for k in ("nheads", "headdim", "dstate",
                                                                                "ngroups", "out_dim"))
    t = mixer_inputs(g, batch, tokens, **MIXER)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)
    weight_out = randn(batch, tokens, out_dim)
    weight_final = randn(batch, nheads, headdim, dstate)
    seq_idx = None if seq_rows is None else torch.tensor(seq_rows, dtype=torch.int32, device=device)
    params = F64 if dtype == F64 else torch.float32
    t = {k: v.to(device=device, dtype=dtype if k == "zxbcdt" else params) for k, v in t.items()}
    kwargs = dict(chunk_size=16, dt_limit=(0.0, 4.0), return_final_states=True, headdim=headdim, ngroups=ngroups,
                  norm_before_gate=False, backend=backend)

    def leaves(part):
        return {k: (v[:, part] if k == "zxbcdt" else v).detach().clone().requires_grad_() for k, v in t.items()}

    whole = leaves(slice(None))
    out, final = tilegym_mamba2.mamba_split_conv1d_scan_combined(seq_idx=seq_idx, **whole, **kwargs)
    ((out.double() * weight_out.to(device)).sum() + (final.double() * weight_final.to(device)).sum()).backward()
    cuts = cuts_for(name, tokens, world)
    part = slice(cuts[rank], cuts[rank + 1])
    mine = leaves(part)
    cp_out, cp_final = context_parallel_split_conv1d_scan_combined(
        seq_idx=None if seq_idx is None else seq_idx[:, part].contiguous(), **mine, **kwargs)
    ((cp_out.double() * weight_out[:, part].to(device)).sum()
     + (cp_final.double() * weight_final.to(device)).sum() / world).backward()
    return differences(out[:, part], final, whole, cp_out, cp_final, mine, part, sliced=("zxbcdt",))


def mixer_cases(world):
    edge = cuts_for("even", 40, world)[1]
    return {"even": (40, None),
            "one_token_slices": (40, [[0] * 40, [0] * 2 + [1] * 38]),
            "boundaries": (40, [[0] * edge + [1] * 3 + [2] * (37 - edge), [t // 4 for t in range(40)]])}


def all_cases(rank, world):
    """Every scan and mixer case on this rank: {case: callable() -> differences}."""
    cases = {f"scan-{name}": functools.partial(scan_case, rank, world, name, tokens, seq_rows, cu, options)
             for name, (tokens, seq_rows, cu, options) in scan_cases(world).items()}
    cases.update({f"mixer-{name}": functools.partial(mixer_case, rank, world, name, tokens, seq_rows)
                  for name, (tokens, seq_rows) in mixer_cases(world).items()})
    return cases


def _guarded(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception:
        return {"crash": traceback.format_exc()}


# --- bad input -----------------------------------------------------------------------------

def _scan_inputs_of(rank, tokens=24, heads=4):
    t, _ = _inputs(3, tokens, 1, dict(D="head"), heads=heads)
    return t


def bad_calls(rank, world):
    """name -> a call that is wrong on some rank (or all); each rank runs it."""
    from tilegym_mamba2.distributed import (context_parallel_causal_conv1d, context_parallel_scan_combined,
                                            context_parallel_split_conv1d_scan_combined)
    scan = functools.partial(context_parallel_scan_combined, chunk_size=16, backend="pytorch")

    def heads_differ():
        t = _scan_inputs_of(rank, heads=4 if rank == 0 else 8)
        return scan(**t)

    def option_differs():
        return scan(**_scan_inputs_of(rank), dt_softplus=rank == 0)

    def one_rank_invalid():
        t = _scan_inputs_of(rank)
        if rank == world - 1:
            t["dt"] = t["dt"][..., :2]
        return scan(**t)

    def cu_seqlens_short():
        return scan(**_scan_inputs_of(rank), cu_seqlens=torch.tensor([0, 5, 24 * world - 1]))

    def seq_idx_unsorted():
        ids = torch.full((1, 24), 2 if rank == 0 else 1, dtype=torch.int32)
        return scan(**_scan_inputs_of(rank), seq_idx=ids)

    def conv_width_differs():
        x = torch.randn(1, 6, 10, dtype=F64)
        return context_parallel_causal_conv1d(x, torch.randn(6, 4 if rank == 0 else 3, dtype=F64))

    def A_values_differ():
        t = _scan_inputs_of(rank)
        t["A"] = t["A"] * (1.0 + rank)
        return scan(**t)

    def mixer_weight_wrong():
        zxbcdt = torch.randn(1, 10, 2 * 8 + 2 * 4 + 2, dtype=F64)
        weight = torch.randn(8 + 2 * 4 if rank == 0 else 5, 4, dtype=F64)
        return context_parallel_split_conv1d_scan_combined(zxbcdt, weight, None, torch.zeros(2, dtype=F64),
                                                           -torch.ones(2, dtype=F64), torch.ones(2, dtype=F64), 16,
                                                           headdim=4, backend="pytorch")

    return {f.__name__: f for f in (heads_differ, option_differs, one_rank_invalid, cu_seqlens_short,
                                    seq_idx_unsorted, conv_width_differs, mixer_weight_wrong, A_values_differ)}


def bad_cases(rank, world):
    """Each bad call -> callable() -> ((exception type, message) on this rank or None, whether a
    good call after it still works: no rank was left inside a collective)."""
    def attempt(call):
        import tilegym_mamba2.distributed as cp
        try:
            call()
            raised = None
        except Exception as e:
            raised = (type(e).__name__, str(e))
        good = cp.context_parallel_scan_combined(**_scan_inputs_of(rank), chunk_size=16, backend="pytorch")
        return raised, bool(torch.isfinite(good).all())
    return {name: functools.partial(attempt, call) for name, call in bad_calls(rank, world).items()}


def gpu_cases(rank, world):
    """bf16 on the cutile backend, every rank on cuda:0: a layer-sized head and packed sequences."""
    sizes = dict(groups=1, heads=8, head_size=64, state=64)
    options = dict(D="head", z=True, dt_bias=True, dt_softplus=True, initial_states=True)
    tokens = 1000
    rows = [[0] * 300 + [1] * 400 + [2] * 300, [0] * 1000]
    cases = {"one_sequence": (None, options), "packed": (rows, options)}
    return {name: functools.partial(scan_case, rank, world, "even", tokens, seq_rows, None, opts, backend="cutile",
                                    dtype=torch.bfloat16, device="cuda", chunk_size=64, sizes=sizes)
            for name, (seq_rows, opts) in cases.items()}
