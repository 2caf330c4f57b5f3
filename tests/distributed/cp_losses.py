"""Spawned ranks for the loss matrix: what each rank's loss uses of a context-parallel op's
outputs (out, final states, both, or nothing on some ranks) x how the sequence is laid out over
the ranks x the op (scan, convolution, mixer). Each rank builds the same global inputs, runs the
single-process op on the whole sequence with the loss that the ranks' losses add up to, and
compares its slice of the outputs and of every gradient (replicated ones summed over the ranks)."""
import functools
import zlib

import torch
import torch.distributed as dist

from cp_workers import MIXER, _diff, mixer_inputs

F64 = torch.float64
LOSSES = ("out", "out_final_last", "final", "out_some")
LAYOUTS = ("unpacked", "seq_idx", "cu_seqlens", "one_token")
OPS = ("scan", "conv", "mixer")


def applies(op, loss):
    """The convolution has no final states."""
    return not (op == "conv" and loss in ("out_final_last", "final"))


def uses_out(loss, rank):
    return loss in ("out", "out_final_last") or (loss == "out_some" and rank % 2 == 0)


def final_share(loss, rank, world):
    return {"final": 1.0 / world, "out_final_last": float(rank == world - 1)}.get(loss, 0.0)


def _ids(offsets):
    return [i for i in range(len(offsets) - 1) for _ in range(offsets[i + 1] - offsets[i])]


def layout(name, world):
    """-> (tokens, cuts, batch, seq_idx rows or None, global cu_seqlens or None). Boundaries sit
    inside slices and exactly at rank edges; "one_token": every rank but the last holds one token."""
    tokens = 10 * world
    cuts = [10 * r for r in range(world + 1)]
    if name == "unpacked":
        return tokens, cuts, 2, None, None
    if name == "seq_idx":
        rows = [_ids([0, 4, cuts[1], tokens]), _ids([0, cuts[-2] + 3, tokens])]
        return tokens, cuts, 2, rows, None
    if name == "cu_seqlens":
        return tokens, cuts, 1, None, [0, 3, cuts[1], cuts[1] + 1, cuts[-2] + 6, tokens]
    if name == "one_token":
        cuts = list(range(world)) + [tokens]
        rows = [[0] * tokens, _ids([0, 1, world + 2, tokens])]   # a sequence starts exactly at rank 1
        return tokens, cuts, 2, rows, None
    if name == "gpu_packed":   # one token on rank 0, sequences starting exactly at ranks 1 and 2
        tokens = 1024
        return tokens, [0, 1, 500, tokens], 1, None, [0, 1, 300, 500, 777, tokens]
    raise ValueError(name)


# --- the ops: (tensors, sliced names, run(tensors, seq_idx, cu_seqlens, cp) -> (out, final or None)) ---

def _scan(g, tokens, batch, cu, dtype, device, sizes):
    groups, heads, head_size, state = sizes

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)
    num_init = len(cu) - 1 if cu is not None else batch
    t = dict(x=randn(batch, tokens, heads, head_size), dt=randn(batch, tokens, heads),
             A=-torch.rand(heads, generator=g, dtype=F64) - 0.3, B=randn(batch, tokens, groups, state),
             C=randn(batch, tokens, groups, state), D=randn(heads), z=randn(batch, tokens, heads, head_size),
             dt_bias=randn(heads), initial_states=randn(num_init, heads, head_size, state))
    sliced = ("x", "dt", "B", "C", "z")

    def run(leaves, seq_idx, cu_seqlens, cp, final):
        import tilegym_mamba2
        from tilegym_mamba2.distributed import context_parallel_scan_combined
        kwargs = dict(chunk_size=16, seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=True,
                      return_final_states=final, backend=backend_of(device))
        op = context_parallel_scan_combined if cp else tilegym_mamba2.mamba_chunk_scan_combined
        return _pair(op(**leaves, **kwargs))
    return t, sliced, 1, run


def _conv(g, tokens, batch, cu, dtype, device, sizes):
    t = dict(x=torch.randn(batch, 6, tokens, generator=g, dtype=F64),
             weight=torch.randn(6, 4, generator=g, dtype=F64) * 0.5, bias=torch.randn(6, generator=g, dtype=F64))

    def run(leaves, seq_idx, cu_seqlens, cp, final):
        from tilegym_mamba2.backends.split_conv1d_scan import causal_conv1d_differentiable
        from tilegym_mamba2.distributed import context_parallel_causal_conv1d
        if cp:
            return context_parallel_causal_conv1d(leaves["x"], leaves["weight"], leaves["bias"], seq_idx,
                                                  "silu"), None
        return causal_conv1d_differentiable(leaves["x"], leaves["weight"], leaves["bias"], seq_idx,
                                            activation="silu"), None
    return t, ("x",), 2, run


GPU_MIXER = dict(nheads=8, headdim=64, dstate=64, ngroups=1, width=4, d_nonssm=0, out_dim=64)  # cuTile's sizes


def _mixer(g, tokens, batch, cu, dtype, device, sizes):
    dims = GPU_MIXER if torch.device(device).type == "cuda" else MIXER
    t = mixer_inputs(g, batch, tokens, **dims)
    headdim, ngroups = dims["headdim"], dims["ngroups"]

    def run(leaves, seq_idx, cu_seqlens, cp, final):
        import tilegym_mamba2
        from tilegym_mamba2.distributed import context_parallel_split_conv1d_scan_combined
        kwargs = dict(chunk_size=16, seq_idx=seq_idx, dt_limit=(0.0, 4.0), return_final_states=final,
                      headdim=headdim, ngroups=ngroups, norm_before_gate=False, backend=backend_of(device))
        op = context_parallel_split_conv1d_scan_combined if cp else tilegym_mamba2.mamba_split_conv1d_scan_combined
        return _pair(op(**leaves, **kwargs))
    return t, ("zxbcdt",), 1, run


def _pair(result):
    """(out, final states or None) whatever return_final_states was."""
    return result if isinstance(result, tuple) else (result, None)


BUILDERS = {"scan": _scan, "conv": _conv, "mixer": _mixer}


def backend_of(device):
    return "cutile" if torch.device(device).type == "cuda" else "pytorch"


def loss_case(rank, world, op, layout_name, loss, dtype=F64, device="cpu", sizes=(2, 4, 8, 8)):
    """One cell of the matrix on this rank -> {quantity: _diff(...)}, "missing grads" (the
    replicated inputs whose gradient is None on this rank while the single-process op's is not
    zero) and "d<name> is None" for each replicated input;
    for "out_some" -> {"raised": (type, message) or None, "usable": a good call afterwards works}."""
    tokens, cuts, batch, rows, cu = layout(layout_name, world)
    g = torch.Generator().manual_seed(zlib.crc32(f"{op}-{layout_name}".encode()))
    if op != "scan" and cu is not None:   # the convolution and the mixer take seq_idx
        rows, batch, cu = [_ids(cu)], 1, None
    t, sliced, token_dim, run = BUILDERS[op](g, tokens, batch, cu, dtype, device, sizes)
    params = F64 if dtype == F64 else torch.float32
    t = {k: v.to(device=device, dtype=dtype if k in sliced else params) for k, v in t.items()}
    part = slice(cuts[rank], cuts[rank + 1])

    def take(v, k):
        return v[(slice(None),) * token_dim + (part,)] if k in sliced else v

    def leaves(whole):
        return {k: (v if whole else take(v, k)).detach().clone().requires_grad_() for k, v in t.items()}
    seq_idx = None if rows is None else torch.tensor(rows, dtype=torch.int32, device=device)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    my_seq_idx = None if seq_idx is None else seq_idx[:, part].contiguous()

    # a loss on out alone makes the plainest call: return_final_states at its default, False
    with_final = loss != "out"
    mine = leaves(False)
    cp_out, cp_final = run(mine, my_seq_idx, cu_seqlens, True, with_final)
    g_out = torch.randn(*(cp_out.shape[:token_dim] + (tokens,) + cp_out.shape[token_dim + 1:]), generator=g, dtype=F64)
    g_final = None if cp_final is None else torch.randn(*cp_final.shape, generator=g, dtype=F64)
    if loss == "out_some":
        return _out_on_some_ranks(rank, mine, cp_out, g_out, token_dim, part, device, run, my_seq_idx, cu_seqlens)
    terms = []
    if uses_out(loss, rank):
        terms.append((cp_out.double() * take(g_out, sliced[0]).to(device)).sum())
    if final_share(loss, rank, world):
        terms.append((cp_final.double() * g_final.to(device)).sum() * final_share(loss, rank, world))
    sum(terms).backward()

    whole = leaves(True)
    out, final = run(whole, seq_idx, cu_seqlens, False, with_final)
    reference = [(out.double() * g_out.to(device)).sum()] if loss != "final" else []
    if loss != "out":
        reference.append((final.double() * g_final.to(device)).sum())
    sum(reference).backward()

    diffs = {"out": _diff(cp_out, take(out, sliced[0]))}
    if final is not None:
        diffs["final_states"] = _diff(cp_final, final)
    missing = []
    for k, leaf in mine.items():
        want = whole[k].grad
        if want is None:
            continue
        if k in sliced:
            diffs[f"d{k}"] = _diff(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf), take(want, k))
            continue
        if leaf.grad is None and bool((want != 0).any()):
            missing.append(k)
        diffs[f"d{k} is None"] = leaf.grad is None   # must be alike on every rank (their all-reduce)
        grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad.clone()
        dist.all_reduce(grad)
        diffs[f"d{k}"] = _diff(grad, want)
    diffs["missing grads"] = missing
    return diffs


def _out_on_some_ranks(rank, mine, cp_out, g_out, token_dim, part, device, run, seq_idx, cu_seqlens):
    """Odd ranks' losses use none of the op's outputs: every rank must raise one clear error (the
    even ranks in backward, the odd ones at their next call) and the group stays usable."""
    raised = None
    try:
        if rank % 2 == 0:
            weight = g_out[(slice(None),) * token_dim + (part,)].to(device)
            (cp_out.double() * weight).sum().backward()
        else:   # a loss on something else: autograd never reaches the op here
            sum(leaf.double().sum() * 0 for leaf in mine.values()).backward()
        with torch.no_grad():   # the next training step's call
            run({k: v.detach() for k, v in mine.items()}, seq_idx, cu_seqlens, True, True)
    except Exception as e:
        raised = (type(e).__name__, str(e))
    with torch.no_grad():
        again = run({k: v.detach() for k, v in mine.items()}, seq_idx, cu_seqlens, True, True)[0]
    return {"raised": raised, "usable": bool(torch.isfinite(again).all())}


def matrix(rank, world, cells):
    """{cell name: callable()} for the cells [(op, layout, loss)] on this rank."""
    return {f"{op}-{lay}-{loss}": functools.partial(loss_case, rank, world, op, lay, loss) for op, lay, loss in cells}


def skipped_backward_without_a_next_call(rank, world):
    """Rank 1's loss uses nothing of the op and it makes no further call: the others must give up
    after TILEGYM_MAMBA2_CP_TIMEOUT seconds with an error naming the call they waited in."""
    def case():
        from tilegym_mamba2.distributed import context_parallel_scan_combined
        x = torch.randn(1, 8, 2, 4, dtype=F64, requires_grad=True)
        out = context_parallel_scan_combined(x, torch.rand(1, 8, 2, dtype=F64), -torch.ones(2, dtype=F64),
                                             torch.randn(1, 8, 1, 4, dtype=F64), torch.randn(1, 8, 1, 4, dtype=F64),
                                             16, backend="pytorch")
        if rank == 1:
            return None
        try:
            out.sum().backward()
        except Exception as e:
            return (type(e).__name__, str(e))
        return None
    return {"skipped": case}


def gpu_cells(rank, world):
    """bf16 on the cutile backend, every rank on cuda:0, loss on out alone: packed sequences with a
    one-token slice and boundaries exactly at rank edges, for the scan and the mixer."""
    return {op: functools.partial(loss_case, rank, world, op, "gpu_packed", "out", dtype=torch.bfloat16,
                                  device="cuda", sizes=(1, 8, 64, 64))
            for op in ("scan", "mixer")}
