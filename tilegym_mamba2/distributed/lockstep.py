"""Every rank of a context-parallel call issues the same collectives in the same order.

Each phase that starts with a collective (a call's forward, the state chain's backward, the
convolution halo's backward) first all-gathers a header of three integers: a tag, the phase and
the call's number on this group. The header has the same shape in every phase, so two ranks in
different phases meet in it instead of in mismatched collectives (a hang, or a native abort in
gloo), and every rank raises the same error, naming the ranks that are out of step.

The usual way to get out of step is a rank whose loss uses none of a call's outputs: autograd
never runs that call's backward there, while the other ranks wait for it. The rank finds out at
its next context-parallel call (it meets the others' backward header); if it makes none, the
ranks left waiting give up after TILEGYM_MAMBA2_CP_TIMEOUT seconds (gloo groups; an NCCL group
has its own watchdog) and name the call they waited in.
"""
import datetime
import os

import torch
import torch.distributed as dist

TIMEOUT_ENV = "TILEGYM_MAMBA2_CP_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
_TAG = 0x4D32  # "M2": a header of ours, not some other collective's data

FORWARD, CHAIN_BACKWARD, HALO_BACKWARD = 1, 2, 3
PHASE_NAMES = {FORWARD: "the forward", CHAIN_BACKWARD: "the state chain's backward",
               HALO_BACKWARD: "the convolution halo's backward"}

_calls_made = {}  # group -> context-parallel calls made on it (the same on every rank in step)


def next_call(group) -> int:
    """The number of the call starting now on ``group`` (1, 2, ...)."""
    _calls_made[group] = _calls_made.get(group, 0) + 1
    return _calls_made[group]


def timeout_seconds() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return value


def _gather_headers(header: torch.Tensor, group, op: str, phase: int, call: int) -> list:
    nccl = "nccl" in str(dist.get_backend(group))
    seconds = None if nccl else timeout_seconds()
    parts = [torch.empty_like(header) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, header, group=group, async_op=True)
    if nccl:
        work.wait()   # NCCL's watchdog bounds the wait
    else:
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
        except RuntimeError as e:
            raise RuntimeError(
                f"{op}: rank {dist.get_rank(group)} waited {seconds:g} s in {PHASE_NAMES[phase]} of call {call} for "
                f"the other ranks of its group, which never joined. Either a rank failed or exited before it "
                f"(its own error says why), or a rank's loss uses none of the call's outputs (neither out nor the "
                f"final states): autograd never runs that call's backward there, and every rank's loss must use out "
                f"or the final states of each call (docs/context_parallel.md). The group is unusable after this "
                f"error. ({e})") from None
    return [tuple(p.tolist()) for p in parts]


def in_step(op: str, group, phase: int, call: int) -> None:
    """All-gathers (phase, call) from every rank of ``group``; raises the same RuntimeError on
    every rank when they differ. Costs one all-gather of three integers (and, on CUDA, one wait)."""
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
        else torch.device("cpu")
    header = torch.tensor([_TAG, phase, call], dtype=torch.int64, device=device)
    headers = _gather_headers(header, group, op, phase, call)
    if all(h == headers[0] for h in headers):
        return
    _calls_made[group] = max(_calls_made.get(group, 0), *(h[2] for h in headers))  # the next call starts in step
    raise RuntimeError(out_of_step_message(op, headers))


def _ranks(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def out_of_step_message(op: str, headers: list) -> str:
    """Where each rank is, who did not follow, and why that happens."""
    where = {}
    for r, (tag, phase, call) in enumerate(headers):
        where.setdefault((phase, call) if tag == _TAG else None, []).append(r)
    parts = [f"{_ranks(ranks)} in " + (f"{PHASE_NAMES.get(state[0], 'phase %d' % state[0])} of call {state[1]}"
                                       if state else "a collective of something else")
             for state, ranks in where.items()]
    text = f"{op}: the ranks of the group are out of step: " + "; ".join(parts) + "."
    backward = [s for s in where if s and s[0] != FORWARD]
    if backward:
        phase, call = max(backward, key=lambda s: s[1])
        missing = [r for r, h in enumerate(headers) if h[1:] != (phase, call)]
        text += (f" {_ranks(missing)} did not run {PHASE_NAMES[phase]} of call {call}: autograd never runs a "
                 f"call's backward on a rank whose loss uses none of the call's outputs (neither out nor the "
                 f"final states), and the other ranks need it. Every rank's loss must use out or the final states "
                 f"of each context-parallel call (docs/context_parallel.md).")
    else:
        text += " Every rank must make each context-parallel call together, in the same order."
    return text
