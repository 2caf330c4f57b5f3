"""What the ranks of a context-parallel call agree on before any large collective.

Each rank checks its own slice, then one small object all-gather carries every rank's verdict,
slice length and call signature (shapes without the tokens dimension, dtypes, options) and the
sequence ids at the slice's edges. An error found on any rank is raised on every rank, naming
the argument, so that no rank is left waiting in a later collective; so is a signature that
differs between ranks. Everything after this exchange is computed from the same gathered
facts on every rank, so later checks fail on all ranks alike.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .lockstep import FORWARD, in_step, next_call


def group_or_world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallelism needs torch.distributed initialized "
                           "(torch.distributed.init_process_group) before the call")
    return dist.group.WORLD if group is None else group


def check_group_device(group, device: torch.device):
    """ValueError naming ``group`` when its backend cannot move tensors of ``device`` (NCCL and
    CPU tensors). A gloo group takes CUDA tensors: they go through host memory."""
    name = str(dist.get_backend(group))
    if device.type == "cpu" and "gloo" not in name and "mpi" not in name:
        raise ValueError(f"group: its backend {name!r} cannot communicate CPU tensors (the inputs are on cpu); "
                         f"use a gloo group for CPU tensors")


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[world, *t.shape]: every rank's ``t``, in rank order, on t's device. A CUDA tensor on a
    group without a CUDA transport (gloo) is staged through host memory."""
    staged = t.contiguous()
    if staged.is_cuda and "nccl" not in str(dist.get_backend(group)):
        staged = staged.cpu()
    parts = [torch.empty_like(staged) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, staged, group=group)
    return torch.stack(parts).to(t.device)


@dataclass(frozen=True)
class Layout:
    """The slices of one context-parallel call, the same on every rank.

    lengths[r]: tokens of rank r's slice.  first_ids[r][b], last_ids[r][b]: the sequence ids of
    row b's first and last token on rank r (0 without packing).  last_run[r][b]: tokens of
    row b's last sequence on rank r.  tail_ids[r][b]: the ids of the last tokens of rank r's
    row b (up to the convolution's width - 1), for the halo.  op, call: the operation and the
    call's number on its group (lockstep.py's headers)."""
    rank: int
    size: int
    lengths: tuple
    first_ids: tuple
    last_ids: tuple
    last_run: tuple
    tail_ids: tuple
    op: str = ""
    call: int = 0

    @property
    def offset(self) -> int:
        return sum(self.lengths[:self.rank])

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def link(self, r: int) -> list[bool]:
        """Per row: does rank r's first sequence go on from rank r - 1's last?"""
        if r == 0:
            return [False] * len(self.first_ids[r])
        return [a == b for a, b in zip(self.first_ids[r], self.last_ids[r - 1])]

    def through(self, r: int) -> list[bool]:
        """Per row: is rank r's slice one sequence (its entering state reaches its end)?"""
        return [a == b for a, b in zip(self.first_ids[r], self.last_ids[r])]


def fingerprints(**tensors) -> dict:
    """{"<name>'s values (checksum)": floats}: two weighted sums and the NaN count of each tensor
    given (None skipped), in one device-to-host copy, so that replicated inputs whose values
    differ between ranks are caught in the agreement step (equal tensors give equal sums)."""
    given = {k: t for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    if not given:
        return {}
    sums = []
    for t in given.values():
        flat = t.detach().reshape(-1).double()
        finite = torch.nan_to_num(flat, nan=0.0, posinf=1.0e300, neginf=-1.0e300)
        weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64).remainder_(7).add_(1)
        sums.append(torch.stack([finite.sum(), (finite * weights).sum(), flat.isnan().sum().double()]))
    values = torch.stack(sums).tolist()
    return {f"{k}'s values (checksum)": tuple(v) for k, v in zip(given, values)}


def edge_ids(seq_idx, batch: int, tokens: int, tail: int):
    """(first ids, last ids, last-run lengths, tail ids) of this rank's rows, on the host: one
    small device-to-host copy of the slice's edges (nothing when there is no seq_idx)."""
    if seq_idx is None:
        return [0] * batch, [0] * batch, [tokens] * batch, [[0] * min(tail, tokens)] * batch
    last = seq_idx[:, -1:]
    run = (seq_idx == last).sum(1, keepdim=True).to(seq_idx.dtype)
    edges = torch.cat([seq_idx[:, :1], last, run, seq_idx[:, tokens - min(tail, tokens):]], 1).tolist()
    return [e[0] for e in edges], [e[1] for e in edges], [e[2] for e in edges], [e[3:] for e in edges]


def agree(op: str, group, check, signature, tokens, edges) -> Layout:
    """Runs ``check()`` (this rank's argument checks) and exchanges the verdicts, signatures
    and edges; raises on every rank if any rank's check failed or a signature differs.

    ``signature``: a dict {argument description: value} of what must be equal on every rank
    (a callable, evaluated only when the check passed); ``edges``: a callable giving edge_ids'
    tuple for this rank."""
    call = next_call(group)
    in_step(op, group, FORWARD, call)   # before anything else: a rank still in a backward shows up here
    error, facts = None, None
    try:
        check()
        facts = {"signature": signature(), "edges": edges()}
    except Exception as e:  # raised below, after every rank has heard of it
        error = e
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    verdict = None if error is None else (type(error).__name__, str(error))
    headers = [None] * size
    dist.all_gather_object(headers, {"error": verdict, "tokens": tokens, "facts": facts}, group=group)
    if error is not None:
        raise error
    for r, header in enumerate(headers):
        if header["error"] is not None:
            kind, message = header["error"]
            exc = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
            raise exc(f"{op}: the arguments of rank {r} are invalid: {message}")
    base = headers[0]["facts"]["signature"]
    for r, header in enumerate(headers[1:], 1):
        for name, value in header["facts"]["signature"].items():
            if value != base[name]:
                raise ValueError(f"{op}: {name} must be the same on every rank of the group: rank 0 has "
                                 f"{base[name]!r}, rank {r} has {value!r}")
    edges_of = [h["facts"]["edges"] for h in headers]
    layout = Layout(rank, size, tuple(h["tokens"] for h in headers), *(tuple(e[i] for e in edges_of) for i in range(4)),
                    op=op, call=call)
    for r in range(1, size):
        for row, (a, b) in enumerate(zip(layout.last_ids[r - 1], layout.first_ids[r])):
            if b < a:
                raise ValueError(f"{op}: seq_idx must be sorted along the global sequence: in row {row}, rank {r}'s "
                                 f"slice starts with id {b} after rank {r - 1}'s ends with id {a}")
    return layout
