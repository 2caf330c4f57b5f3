"""Experiment 77 (GPU; compiles on a CPU with --resources): the plain op's short rows in one
launch, its segments chained through memory. The package's kernel (experiment 78) is
tilegym_mamba2/cutile/chained_prefill.py, the "staged" chain of this script except that it loads
the staged sums without TMA: this script's TMA loads are faster (0.047 against 0.076 ms) but made
the package's final state vary between repeated calls (experiment 79; experiment 81 traced it
to the last bit of the compiled TMA form's own-state phase, so these loads likely vary here
too). The script keeps the
switches its probes timed (where the decay sums come from, the parts, the look-back, 64-token
chunks, load hints).

Experiment 75's one launch reached the host target (23-27 us per call) but every block redid the
state walk before its segment, so its kernels took 0.13-0.39 ms against 0.066 for two launches
and 0.035 for the four-launch segmented path (run78, run83). Here no block repeats another's
work: block (row and head, segment, head tile)
  1. computes its segment's own state from zero and the segment's total decay (its chunks' decay
     sums are computed in the block: cumsum of a * dt over the chunk, times log2 e);
  2. waits until the block of the segment before has published the state entering this one (a
     flag in memory, polled with an atomic compare-and-swap that also clears it), then publishes
     the state leaving its own segment, entry * exp2(decay) + own, and sets the next flag (a
     release); the last segment stores the final state instead;
  3. computes its chunks' outputs from the entry state, as compute_out does.
The chain's serial part is one load, one multiply-add and one store per segment; the rest runs
in parallel. A block takes a ticket (an atomic counter) when it starts and works on the segment
the ticket names, segment-major, so a block only ever waits for one that started before it: no
deadlock whatever order the hardware starts blocks in. The last ticket resets the counter, and
each flag is cleared by the one block that waits on it, so the workspace (flags, counter, the
published states: one per stream, kept between calls) is clean when the kernel ends and the
launch replays in a CUDA graph.

Prediction, the 2048-token prefill (1, 2048, 1, 32, 128, 64), chunk 128 (16 chunks): host per
call ~25 us (one launch, two outputs allocated, as experiment 75's 23-27); kernel ~0.025-0.04 ms
at 2-4 chunks per segment (per segment hop ~2-3 us of flag, load and store latency; each block's
own state and outputs ~2-4 us per chunk), so `bench` ~0.03-0.045 ms against 0.076. Outputs are
not the package's bits (the entry states are combined as the state pass does, not as a walk), so
they are checked against the float64 reference at the package's tolerance.

    python3 benchmarks/variants/chained_prefill.py
    python benchmarks/variants/chained_prefill.py --resources   (CPU: compiles for sm_90)
"""
import math
import os
import statistics
import sys

import cuda.tile as ct
import torch
from cuda.tile._cext import launch as cutile_launch

LOG2E = math.log2(math.e)
PREFILL = (1, 2048, 1, 32, 128, 64)
COMPUTED, GIVEN, STAGED = 0, 1, 2  # where each phase gets the chunks' decay sums (chained_prefill)
SUMS = {"computed": COMPUTED, "given": GIVEN, "staged": STAGED}
# A probe of where the time goes (chained_prefill's ``parts``): the own states only (no wait, no
# outputs), those and the chain, or the whole kernel.
OWN_STATES, CHAINED, WHOLE = 1, 2, 3
CHECKED_SUMS = {1: "computed", 2: "staged", 4: "given"}  # the correctness rows' choice per segment length


@ct.kernel(occupancy=2)
def chained_prefill_kernel(x, b, c, d, dt, a, init_state, out, final_state, published, flags, tickets, dt_bht,
                           decay_cumsum, segment_decays, generation, chunks_per_segment, segments,
                           chunk_size: ct.Constant[int], head_tile: ct.Constant[int], state_size: ct.Constant[int],
                           has_init: ct.Constant[bool], sums: ct.Constant[int], tf32: ct.Constant[bool],
                           parts: ct.Constant[int], lookback: ct.Constant[bool],
                           load_latency: ct.Constant[int]):
    mma_dtype = ct.tfloat32 if tf32 else x.dtype
    heads = x.shape[2]
    p_tiles = x.shape[3] // head_tile
    blocks_per_segment = x.shape[0] * heads * p_tiles
    ticket = ct.atomic_add(tickets, 0, 1)
    if ticket == blocks_per_segment * segments - 1:
        ct.atomic_xchg(tickets, 0, 0)  # every ticket is taken: the counter is ready for the next launch
    segment = ticket // blocks_per_segment
    lane = ticket % blocks_per_segment  # (row and head, head tile)
    batch_head, p_tile = lane // p_tiles, lane % p_tiles
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    num_chunks = ct.cdiv(x.shape[1], chunk_size)
    first = segment * chunks_per_segment
    last = min(first + chunks_per_segment, num_chunks)
    a_head = ct.load(a, (head,), (1,))
    hint = None if load_latency == 0 else load_latency  # compute_out's hint (tuning.py), 0: the compiler's
    zero = ct.PaddingMode.ZERO

    # 1. The segment's own state (from zero) and its decay, before any wait.
    own = ct.zeros((head_tile, state_size), dtype=ct.float32)
    segment_decay = ct.zeros((1,), dtype=ct.float32)
    for chunk in range(first, last):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=zero, latency=hint).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=zero, latency=hint).reshape((chunk_size, state_size))
        dt_tile, g = _decay_sums(dt, a_head, dt_bht, decay_cumsum, batch, chunk, head, chunk_size, sums == GIVEN)
        if sums == STAGED:  # kept for the outputs' phase, in chunk_cumsum's layout
            ct.store(dt_bht, (batch, head, chunk), dt_tile.reshape((1, 1, chunk_size)))
            ct.store(decay_cumsum, (batch, head, chunk), g.reshape((1, 1, chunk_size)))
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        weighted_b = (b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]).astype(mma_dtype)
        own = ct.mma(ct.transpose(x_tile.astype(mma_dtype)), weighted_b, own * ct.exp2(g_last))
        segment_decay = segment_decay + g_last
    if sums == STAGED:
        # Orders this block's stores of the sums before its loads of them in the outputs' phase.
        ct.atomic_add(tickets, 1, 0, memory_order=ct.MemoryOrder.ACQ_REL, memory_scope=ct.MemoryScope.BLOCK)

    # 2. The chain: the entry state from the segment before, the leaving state to the next.
    if lookback:
        entry = _looked_back_entry(init_state, published, flags, segment_decays, own, segment_decay, generation,
                                   batch, head, batch_head, p_tile, lane, segment, blocks_per_segment,
                                   last < num_chunks, head_tile, state_size, has_init, parts >= CHAINED)
        if last >= num_chunks:
            leaving = entry * ct.exp2(segment_decay) + own
            ct.store(final_state, (batch, head, p_tile, 0), leaving.reshape((1, 1, head_tile, state_size)))
    else:
        if segment == 0 or parts < CHAINED:
            if has_init:
                entry = ct.load(init_state, (batch, head, p_tile, 0), (1, 1, head_tile, state_size)).reshape(
                    (head_tile, state_size))
            else:
                entry = ct.zeros((head_tile, state_size), dtype=ct.float32)
        else:
            flag = (segment - 1) * blocks_per_segment + lane
            seen = ct.atomic_cas(flags, flag, 1, 0, memory_order=ct.MemoryOrder.ACQUIRE)
            while seen != 1:
                seen = ct.atomic_cas(flags, flag, 1, 0, memory_order=ct.MemoryOrder.ACQUIRE)
            entry = ct.load(published, (segment - 1, batch_head, p_tile, 0), (1, 1, head_tile, state_size),
                            allow_tma=False).reshape((head_tile, state_size))
        leaving = entry * ct.exp2(segment_decay) + own
        if last < num_chunks and parts >= CHAINED:
            ct.store(published, (segment, batch_head, p_tile, 0), leaving.reshape((1, 1, head_tile, state_size)),
                     allow_tma=False)
            ct.atomic_xchg(flags, segment * blocks_per_segment + lane, 1, memory_order=ct.MemoryOrder.RELEASE)
        else:
            ct.store(final_state, (batch, head, p_tile, 0), leaving.reshape((1, 1, head_tile, state_size)))

    # 3. The outputs, as compute_out computes them, from the entry state.
    state = entry
    skip = ct.load(d, (head,), (1,)).reshape((1, 1))
    token = ct.arange(chunk_size, dtype=ct.int32)
    causal = token[:, None] >= token[None, :]
    never = ct.full((chunk_size, chunk_size), -float("inf"), dtype=ct.float32)
    for chunk in range(first, last if parts == WHOLE else first):
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=zero, latency=hint).reshape((chunk_size, head_tile))
        b_tile = ct.load(b, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=zero, latency=hint).reshape((chunk_size, state_size))
        c_tile = ct.load(c, (batch, chunk, group, 0), (1, chunk_size, 1, state_size),
                         padding_mode=zero, latency=hint).reshape((chunk_size, state_size))
        dt_tile, g = _decay_sums(dt, a_head, dt_bht, decay_cumsum, batch, chunk, head, chunk_size, sums != COMPUTED)
        g_last = ct.extract(g, (chunk_size - 1,), (1,))
        c_b = ct.mma(c_tile.astype(mma_dtype), ct.transpose(b_tile.astype(mma_dtype)),
                     ct.zeros((chunk_size, chunk_size), dtype=ct.float32))
        decay = ct.exp2(ct.where(causal, g[:, None] - g[None, :], never))
        weights = (c_b * decay * dt_tile[None, :]).astype(mma_dtype)
        y = ct.mma(weights, x_tile.astype(mma_dtype), ct.zeros((chunk_size, head_tile), dtype=ct.float32))
        c_decayed = (c_tile.astype(ct.float32) * ct.exp2(g)[:, None]).astype(mma_dtype)
        y = ct.mma(c_decayed, ct.transpose(state.astype(mma_dtype)), y)
        y = y + skip * x_tile.astype(ct.float32)
        ct.store(out, (batch, chunk, head, p_tile), y.astype(out.dtype).reshape((1, chunk_size, 1, head_tile)))
        weighted_b = (b_tile.astype(ct.float32) * (dt_tile * ct.exp2(g_last - g))[:, None]).astype(mma_dtype)
        state = ct.mma(ct.transpose(x_tile.astype(mma_dtype)), weighted_b, state * ct.exp2(g_last))


@ct.function
def _looked_back_entry(init_state, published, flags, segment_decays, own, segment_decay, generation, batch, head,
                       batch_head, p_tile, lane, segment, blocks_per_segment, publishes, head_tile, state_size,
                       has_init, waits):
    """The look-back: every segment but the last publishes its own state and decay as soon as it
    has them (the flag holds the launch's generation, so no flag is ever cleared), and each
    segment sums the published states of all the segments before it, decayed, nearest first:
    one wait for states published at about the same time, not a hop per segment."""
    if publishes and waits:
        ct.store(published, (segment, batch_head, p_tile, 0), own.reshape((1, 1, head_tile, state_size)),
                 allow_tma=False)
        ct.store(segment_decays, (segment, lane), segment_decay.reshape((1, 1)))
        ct.atomic_xchg(flags, segment * blocks_per_segment + lane, generation, memory_order=ct.MemoryOrder.RELEASE)
    entry = ct.zeros((head_tile, state_size), dtype=ct.float32)
    decayed = ct.zeros((1,), dtype=ct.float32)  # log2 decay from the end of segment `earlier` to this one
    for back in range(segment if waits else 0):
        earlier = segment - 1 - back
        flag = earlier * blocks_per_segment + lane
        seen = ct.atomic_add(flags, flag, 0, memory_order=ct.MemoryOrder.ACQUIRE)
        while seen != generation:
            seen = ct.atomic_add(flags, flag, 0, memory_order=ct.MemoryOrder.ACQUIRE)
        earlier_state = ct.load(published, (earlier, batch_head, p_tile, 0), (1, 1, head_tile, state_size),
                                allow_tma=False).reshape((head_tile, state_size))
        entry = entry + earlier_state * ct.exp2(decayed)
        decayed = decayed + ct.load(segment_decays, (earlier, lane), (1, 1), allow_tma=False).reshape((1,))
    if has_init:
        entry = entry + ct.load(init_state, (batch, head, p_tile, 0), (1, 1, head_tile, state_size)).reshape(
            (head_tile, state_size)) * ct.exp2(decayed)
    return entry


@ct.function
def _decay_sums(dt, a_head, dt_bht, decay_cumsum, batch, chunk, head, chunk_size, given_sums):
    """The chunk's dt and log2 decay sums: computed here, or read in chunk_cumsum's layout."""
    if given_sums:
        return (ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,)),
                ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size)).reshape((chunk_size,)))
    dt_tile = ct.load(dt, (batch, chunk, head), (1, chunk_size, 1), padding_mode=ct.PaddingMode.ZERO).astype(
        ct.float32).reshape((chunk_size,))
    return dt_tile, ct.cumsum(dt_tile * a_head, axis=0) * LOG2E


# At 255 registers with 192 bytes of stack at two blocks per SM (CPU compile): one block per SM, timed too.
ONE_PER_SM = chained_prefill_kernel.replace_hints(occupancy=1)

_workspaces = {}  # (device, stream) -> (flags, tickets, published): clean between launches


def workspace(device, stream, blocks, published_shape, lookback):
    key = (device, stream, lookback)  # the two protocols leave different values in the flags
    flags, tickets, published, decays = _workspaces.get(key, (None, None, None, None))
    if flags is None or flags.numel() < blocks:
        flags = torch.zeros(blocks, dtype=torch.int32, device=device)
        tickets = torch.zeros(2, dtype=torch.int32, device=device)  # the counter; a word for the fence
        decays = torch.empty(blocks, dtype=torch.float32, device=device)
    if published is None or published.numel() < math.prod(published_shape):
        published = torch.empty(math.prod(published_shape), dtype=torch.float32, device=device)
    _workspaces[key] = flags, tickets, published, decays
    return flags, tickets, published[:math.prod(published_shape)].view(published_shape), decays


_generation = [0]  # the look-back's flag value of the latest launch (flags start at 0)


def staged_sums(device, stream, shape):
    """The workspace's [2, batch, heads, padded tokens] buffer for staged dt and decay sums."""
    key = ("sums", device, stream)
    buffer = _workspaces.get(key)
    if buffer is None or buffer.numel() < math.prod(shape):
        buffer = _workspaces[key] = torch.empty(math.prod(shape), dtype=torch.float32, device=device)
    return buffer[:math.prod(shape)].view(shape).unbind(0)


def chained_prefill(x, a, b, c, d, dt, init_state, chunk_size, chunks_per_segment, head_tile, *, tf32=False,
                    launch=None, kernel=chained_prefill_kernel, sums="computed", parts=WHOLE, lookback=False,
                    load_latency=0):
    """The plain op's checked arguments -> (out, final_state), in one launch. ``sums``: the chunks'
    dt and decay sums "computed" in both phases; "staged", computed in the first and stored in the
    workspace for the second; "given", a probe: chunk_cumsum launched first and both phases read
    its output."""
    from tilegym_mamba2.cutile import launch as launches
    from tilegym_mamba2.cutile.chunk_cumsum import chunk_cumsum
    batch, tokens, heads, head_size = x.shape
    state_size = b.shape[3]
    segments = -(-(-(-tokens // chunk_size)) // chunks_per_segment)
    p_tiles = head_size // head_tile
    device = x.get_device()
    stream = launches.current_stream(device)
    lanes = batch * heads * p_tiles
    flags, tickets, published, decays = workspace(device, stream, segments * lanes,
                                                  (max(segments - 1, 1), batch * heads, head_size, state_size),
                                                  lookback)
    _generation[0] = _generation[0] % (2**31 - 1) + 1
    out = launches.new_output(*x.shape, dtype=x.dtype, device=x.device)
    final_state = launches.new_output(batch, heads, head_size, state_size, dtype=torch.float32, device=x.device)
    if sums == "given":
        dt_bht, decay_cumsum = chunk_cumsum(dt, a, chunk_size)
    elif sums == "staged":
        dt_bht, decay_cumsum = staged_sums(device, stream, (2, batch, heads, -(-tokens // chunk_size) * chunk_size))
    else:
        dt_bht = decay_cumsum = published  # unread
    args = (x, b, c, d, dt, a, final_state if init_state is None else init_state, out, final_state, published,
            flags, tickets, dt_bht, decay_cumsum, decays[:segments * lanes].view(segments, lanes), _generation[0],
            chunks_per_segment, segments, chunk_size, head_tile, state_size, init_state is not None, SUMS[sums], tf32,
            parts, lookback, load_latency)
    # cuTile's own launch (importing tilegym wraps ct.launch).
    (launch or cutile_launch)(stream, (segments * batch * heads * p_tiles, 1, 1), kernel, args)
    return out, final_state


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def check(shape, per_segment, dtype, with_init, seed, sums="computed", chunk=128, lookback=False):
    """Errors against float64 (and the package's, the same inputs) after a NaN-filled output."""
    import tilegym_mamba2
    from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
    from tilegym_mamba2.validation import check_forward_args
    torch.manual_seed(seed)
    spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, dtype=dtype, device="cuda")
    sample = spec.get_sample_inputs(with_reference=True, with_backward=False)
    inputs = forward_inputs(sample)
    if not with_init:
        inputs["init_state"] = None
        sample = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, dtype=dtype, device="cuda")._references(
            dict(sample, init_state=None))
    from tilegym_mamba2.cutile.launch import poisoned_outputs
    args = check_forward_args(**inputs, backend="cutile")
    x, a, b, c, d, dt, init, _ = args
    with poisoned_outputs():
        out, final = chained_prefill(x, a, b, c, d, dt, init, chunk, per_segment, 64, sums=sums, lookback=lookback)
        torch.cuda.synchronize()
        again, _ = chained_prefill(x, a, b, c, d, dt, init, chunk, per_segment, 64, sums=sums, lookback=lookback)
    package_out, package_final = tilegym_mamba2.mamba2_chunk_forward(**inputs)
    return (rel_err(out, sample["out"]), rel_err(final, sample["final_state"]),
            rel_err(package_out, sample["out"]), rel_err(package_final, sample["final_state"]),
            bool(torch.isnan(out).any() or torch.isnan(final).any()), torch.equal(out, again))


def main():
    import tilegym_mamba2
    from tilegym_mamba2.bench import measure
    from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
    from tilegym_mamba2.validation import check_forward_args
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from timing import host_us, queued_ms  # this folder's
    print("## against float64 (out, final state), the package's errors beside; NaN; two calls equal")
    cases = [] if "--timing" in sys.argv else [(PREFILL, torch.bfloat16, True), (PREFILL, torch.bfloat16, False), ((2, 1000, 2, 8, 64, 128),
             torch.float16, True), ((1, 4096, 1, 16, 64, 64), torch.float32, False)]
    for shape, dtype, with_init in cases:
        for per_segment in (1, 2, 4):
            e = check(shape, per_segment, dtype, with_init, seed=per_segment, sums=CHECKED_SUMS[per_segment])
            print(f"{str(shape):28s} {str(dtype)[6:]:9s} init {with_init!s:5s} {per_segment} chunks/segment, sums {CHECKED_SUMS[per_segment]}: "
                  f"out {e[0]:.2e} final {e[1]:.2e} | package {e[2]:.2e} {e[3]:.2e} | NaN {e[4]} | repeat equal {e[5]}",
                  flush=True)
    spec = Mamba2ProblemSpec.from_shape(PREFILL, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    args = check_forward_args(**inputs, backend="cutile")
    x, a, b, c, d, dt, init, _ = args
    paths = {"package (as tuned)": lambda: tilegym_mamba2.mamba2_chunk_forward(**inputs)}
    for per_segment in (1, 2, 4, 8):
        paths[f"chained, {per_segment} chunks"] = (
            lambda n=per_segment: chained_prefill(x, a, b, c, d, dt, init, 128, n, 64))
    for per_segment in (2, 4):
        paths[f"chained, {per_segment} chunks, 1/SM"] = (
            lambda n=per_segment: chained_prefill(x, a, b, c, d, dt, init, 128, n, 64, kernel=ONE_PER_SM))
        for sums in ("staged", "given"):
            paths[f"sums {sums}, {per_segment} chunks"] = (
                lambda n=per_segment, sums=sums: chained_prefill(x, a, b, c, d, dt, init, 128, n, 64, sums=sums))
    for fn in paths.values():
        for _ in range(20):
            fn()
    rows = {name: {"host us": [], "bench ms": [], "gpu ms": []} for name in paths}
    for _ in range(5):
        for name, fn in paths.items():
            rows[name]["host us"].append(host_us(fn))
            rows[name]["bench ms"].append(measure(fn))
            rows[name]["gpu ms"].append(queued_ms(fn))
    print("## the prefill (1, 2048, 1, 32, 128, 64) bf16, medians of 5 alternating rounds")
    for name in paths:
        print(f"{name:26s} " + "  ".join(f"{k} {statistics.median(v):.4g}" for k, v in rows[name].items()))


def graph_ms(fn, calls=20):
    """GPU milliseconds per call with no host time (``calls`` calls in one CUDA graph)."""
    from timing import graph_us  # this folder's
    return graph_us([fn] * calls) / 1e3


def probe():
    """Where the kernel's time goes: its parts, by segment length and by how a segment gets its
    entry state (the chain: a hop per segment; the look-back: every earlier segment's own state),
    GPU time from graph replay (the partial kernels' outputs are not checked), after checks of
    the look-back; then host and `bench` times."""
    from tilegym_mamba2.bench import measure
    from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
    from tilegym_mamba2.validation import check_forward_args
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from timing import host_us  # this folder's
    print("## the look-back against float64 (out, final state), the package's errors beside; NaN; two calls equal")
    for shape, dtype, with_init, per_segment in ((PREFILL, torch.bfloat16, True, 2),
                                                 ((2, 1000, 2, 8, 64, 128), torch.float16, False, 3)):
        e = check(shape, per_segment, dtype, with_init, seed=per_segment, sums="staged", lookback=True)
        print(f"{str(shape):28s} {str(dtype)[6:]:9s} init {with_init!s:5s} {per_segment} chunks/segment: "
              f"out {e[0]:.2e} final {e[1]:.2e} | package {e[2]:.2e} {e[3]:.2e} | NaN {e[4]} | repeat equal {e[5]}",
              flush=True)
    spec = Mamba2ProblemSpec.from_shape(PREFILL, chunk_size=128, device="cuda")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    x, a, b, c, d, dt, init, _ = check_forward_args(**inputs, backend="cutile")
    print("## probe: GPU ms per call in graph replay (the prefill, bf16, chunk 128, sums staged, the chain)")
    variants = {f"{n} chunks/segment, load latency {hint}": dict(per_segment=n, load_latency=hint)
                for n in (3, 4) for hint in (0, 1)}
    for name, kw in variants.items():
        row = []
        for parts, part in ((OWN_STATES, "own states"), (CHAINED, "+ entry"), (WHOLE, "+ outputs")):
            fn = (lambda: chained_prefill(x, a, b, c, d, dt, init, 128, kw["per_segment"], 64, sums="staged",
                                          parts=parts, load_latency=kw["load_latency"]))
            row.append(f"{part} {graph_ms(fn):.4f}")
        print(f"{name:36s}: " + "  ".join(row), flush=True)
    print("## host us per call and bench ms (L2 flushed), medians of 3 alternating rounds")
    import tilegym_mamba2
    paths = {"package (as tuned)": lambda: tilegym_mamba2.mamba2_chunk_forward(**inputs)}
    for name, kw in variants.items():
        paths[name] = lambda kw=kw: chained_prefill(x, a, b, c, d, dt, init, 128, kw["per_segment"], 64,
                                                    sums="staged", load_latency=kw["load_latency"])
    rows = {name: ([], []) for name in paths}
    for _ in range(3):
        for name, fn in paths.items():
            rows[name][0].append(host_us(fn))
            rows[name][1].append(measure(fn))
    for name, (host, bench) in rows.items():
        print(f"{name:32s} host us {statistics.median(host):.1f}  bench ms {statistics.median(bench):.4f}")


def resources():
    """Compiles the kernel for sm_90 on CPU placeholders of the prefill (no GPU)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from kernel_remarks import compile_and_report  # this folder's
    batch, tokens, _, heads, state_size, head_size = PREFILL  # the benchmarks' order
    x = torch.zeros(batch, tokens, heads, head_size, dtype=torch.bfloat16)
    b = torch.zeros(batch, tokens, 1, state_size, dtype=torch.bfloat16)
    from tilegym_mamba2.cutile import launch as launches
    launches.current_stream = lambda device: 0  # CPU placeholders: no stream, nothing launched
    globals()["workspace"] = lambda device, stream, blocks, shape, lookback: (
        torch.zeros(blocks, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(shape),
        torch.zeros(blocks))
    globals()["staged_sums"] = lambda device, stream, shape: torch.zeros(shape).unbind(0)
    with launches.recording_launches() as recorded:
        for sums, lookback in (("computed", False), ("staged", False), ("staged", True)):
            chained_prefill(x, torch.zeros(heads), b, b.clone(), torch.zeros(heads), torch.zeros(batch, tokens, heads),
                            None, int(os.environ.get("CHUNK", 128)), 2, 64, sums=sums, lookback=lookback,
                            launch=lambda stream, grid, kernel, args: recorded.append((kernel, args)))
    compile_and_report(recorded)


if __name__ == "__main__":
    resources() if "--resources" in sys.argv else probe() if "--probe" in sys.argv else main()
