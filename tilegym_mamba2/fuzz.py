"""``python -m tilegym_mamba2 fuzz --seconds N``: random shapes and options against the float64
definitions, and malformed calls that must raise cleanly, until the time is up.

Each case draws its own seed (printed with a failure, so that ``--seed`` replays it):
  layer      mamba_chunk_scan_combined: ragged token counts, groups, D per head or channel, z,
             dt_bias, softplus, dt_limit, initial states, packed sequences (seq_idx or
             cu_seqlens, per-sequence initial states), final and varlen states; against
             layer_token_recurrence in float64. Outputs are poisoned (NaN) first on the GPU.
  serving    selective_state_update and causal_conv1d_update with continuous-batching indices
             (padding rows included), causal_conv1d_fn with packed sequences; against their
             references in float64, states compared too.
  malformed  a valid layer, mixer (mamba_split_conv1d_scan_combined) or serving call with one
             argument broken (a shape, a dtype, a type, an index out of range, a bad option value):
             it must raise ValueError or TypeError naming that argument, and leave every state
             it was given as it was.
  many_sequences  the layer case with hundreds of 1-4 token sequences packed with cu_seqlens.
  extreme_decay   the layer case with one head's A at -inf, -1e38 or -3e38 (its decay past fp32).
  isolation  a packed layer call with its options drawn (varlen, final and per-sequence initial
             states), NaN planted in one sequence's input: every other sequence's outputs and
             gradients must be the clean call's.
The cutile backend on a GPU, the pytorch backend otherwise.
"""
import random
import re
import time
import traceback

import torch

from .testing.errors import relative_error

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-3}


def _layer_case(rng, device, packed=False, many=False):
    """-> (kwargs of mamba_chunk_scan_combined, dtype); ``packed``: two sequences or more; ``many``:
    many short ones (1 to 4 tokens each) packed with cu_seqlens."""
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    groups = rng.choice([1, 2])
    heads = groups * rng.choice([1, 2, 4])
    head_size, state = rng.choice([16, 32, 64]), rng.choice([16, 32, 64])
    tokens = rng.randint(64, 600) if many else rng.randint(2 if packed else 1, 300)
    packing = "cu_seqlens" if many else rng.choice(["seq_idx", "cu_seqlens"] if packed else
                                                    ["none", "seq_idx", "cu_seqlens"])
    batch = 1 if packing == "cu_seqlens" else rng.randint(1, 3)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)
    kw = dict(x=randn(batch, tokens, heads, head_size), dt=randn(batch, tokens, heads, scale=0.5),
              A=-(torch.rand(heads, generator=g) + 0.2).to(device), B=randn(batch, tokens, groups, state, scale=0.5),
              C=randn(batch, tokens, groups, state, scale=0.5), chunk_size=rng.choice([64, 128, 256]),
              dt_softplus=rng.random() < 0.7)
    if rng.random() < 0.5:
        kw["D"] = randn(heads, dt=torch.float32) if rng.random() < 0.5 else randn(heads, head_size, dt=torch.float32)
    if rng.random() < 0.5:
        kw["z"] = randn(batch, tokens, heads, head_size)
    if rng.random() < 0.5:
        kw["dt_bias"] = randn(heads, scale=0.5, dt=torch.float32)
    if rng.random() < 0.3:
        kw["dt_limit"] = (0.001, rng.choice([0.5, 2.0]))
    cuts = sorted(rng.sample(range(1, tokens), min(tokens - 1, rng.randint(int(packed), 6)))) if tokens > 1 else []
    if many:
        cuts = [0]
        while cuts[-1] + 4 < tokens:
            cuts.append(cuts[-1] + rng.randint(1, 4))
        cuts = cuts[1:]
    if packing == "seq_idx":
        ids = [sum(t >= c for c in cuts) for t in range(tokens)]
        kw["seq_idx"] = torch.tensor([ids] * batch, dtype=torch.int32, device=device)
    elif packing == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor([0, *cuts, tokens], dtype=torch.int32, device=device)
        kw["return_varlen_states"] = rng.random() < 0.5
    if rng.random() < 0.5:
        rows = len(cuts) + 1 if packing == "cu_seqlens" and rng.random() < 0.5 else batch
        kw["initial_states"] = randn(rows, heads, head_size, state, dt=torch.float32)
    kw["return_final_states"] = rng.random() < 0.5
    return kw, dtype


def check_layer(rng, backend, device):
    return _against_recurrence(*_layer_case(rng, device), backend)


def check_many_sequences(rng, backend, device):
    """Hundreds of sequences of 1 to 4 tokens in one row (serving batches, SFT packing)."""
    return _against_recurrence(*_layer_case(rng, device, many=True), backend)


def check_extreme_decay(rng, backend, device):
    """One head's decay past fp32's range (A = -inf, or A * dt overflowing): its state is forgotten
    at every token, and every output stays finite."""
    kw, dtype = _layer_case(rng, device, packed=rng.random() < 0.5)
    kw["A"][rng.randrange(kw["A"].shape[0])] = rng.choice([-float("inf"), -1e38, -3e38])
    kw["dt_softplus"] = True  # dt > 0: A * dt = -inf * 0 has no limit the recurrence defines
    kw.pop("dt_limit", None)
    return _against_recurrence(kw, dtype, backend)


def _against_recurrence(kw, dtype, backend):
    import tilegym_mamba2
    from .runtime.launch import poisoned_outputs
    from .ssd.reference.layer import layer_token_recurrence
    with poisoned_outputs():
        got = tilegym_mamba2.mamba_chunk_scan_combined(**kw, backend=backend)
    got = got if isinstance(got, tuple) else (got,)
    ref = layer_token_recurrence(*(kw.get(k) for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states",
                                                       "seq_idx", "cu_seqlens")),
                                 dt_softplus=kw["dt_softplus"], dt_limit=kw.get("dt_limit", (0.0, float("inf"))))
    wanted = [ref[0]] + ([ref[1]] if kw["return_final_states"] else []) + \
             ([ref[2]] if kw.get("return_varlen_states") else [])
    errors = [relative_error(a, b) for a, b in zip(got, wanted)]
    return max(errors) <= TOLERANCE[dtype], f"errors {['%.2e' % e for e in errors]} (tolerance {TOLERANCE[dtype]})"


def _sequences(kw):
    """[(row, first token, end)] of every packed sequence of a layer case."""
    if kw.get("cu_seqlens") is not None:
        bounds = kw["cu_seqlens"].tolist()
        return [(0, a, b) for a, b in zip(bounds, bounds[1:])]
    ids = kw["seq_idx"][0].tolist()
    starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]] + [len(ids)]
    return [(row, a, b) for row in range(kw["seq_idx"].shape[0]) for a, b in zip(starts, starts[1:])]


def check_isolation(rng, backend, device):
    """A packed call with its options drawn and NaN planted in one sequence's input: every other
    sequence's outputs and gradients (its own initial state's too) are the clean call's."""
    import tilegym_mamba2
    kw, dtype = _layer_case(rng, device, packed=True)
    sequences = _sequences(kw)
    per_sequence = kw.get("initial_states") is not None and kw["initial_states"].shape[0] == len(sequences) > 1 \
        and kw.get("cu_seqlens") is not None
    names = [n for n in ("x", "dt", "B", "C", "z") if kw.get(n) is not None] + \
        (["initial_states"] if per_sequence else [])
    where, hit = rng.choice(names), rng.randrange(len(sequences))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))

    def run(poisoned):
        leaves = {n: kw[n].detach().clone().requires_grad_() for n in names}
        if poisoned:
            row, a, b = sequences[hit]
            with torch.no_grad():
                if where == "initial_states":
                    leaves[where][hit].view(-1)[0] = float("nan")
                else:
                    leaves[where][row, rng_token].view(-1)[0] = float("nan")
        out = tilegym_mamba2.mamba_chunk_scan_combined(**{**kw, **leaves}, backend=backend)
        out = out if isinstance(out, tuple) else (out,)
        sum((o.double() * w).sum() for o, w in zip(out, weights)).backward()
        return out[0].detach(), {n: leaves[n].grad for n in names}
    rng_token = rng.randrange(sequences[hit][1], sequences[hit][2])
    probe = tilegym_mamba2.mamba_chunk_scan_combined(**kw, backend=backend)
    weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(device)
               for o in (probe if isinstance(probe, tuple) else (probe,))]
    (clean_out, clean), (out, grads) = run(False), run(True)
    errors = []
    for s, (row, a, b) in enumerate(sequences):
        if s == hit:
            continue
        pairs = [(out[row, a:b], clean_out[row, a:b])] + [(grads[n][row, a:b], clean[n][row, a:b])
                                                          for n in names if n != "initial_states"]
        if per_sequence:
            pairs.append((grads["initial_states"][s], clean["initial_states"][s]))
        errors += [relative_error(got, want) if want.abs().sum() > 0 else float(not torch.isfinite(got).all())
                   for got, want in pairs]
    worst = max(errors, default=0.0)
    return worst <= TOLERANCE[dtype], f"NaN in {where} of sequence {hit}: worst error elsewhere {worst:.2e}"


def _mixer_case(rng, device):
    """-> kwargs of a valid mamba_split_conv1d_scan_combined call (small, every weight given)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    nheads, headdim, dstate, ngroups = 4, 16, 16, rng.choice([1, 2])
    width, d_nonssm, dim = rng.choice([2, 3, 4]), rng.choice([0, 3]), 4 * 16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)
    channels = 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads
    return dict(zxbcdt=randn(1, rng.randint(1, 100), channels), conv1d_weight=randn(dim + 2 * ngroups * dstate, width),
                conv1d_bias=randn(dim + 2 * ngroups * dstate), dt_bias=randn(nheads), A=-torch.rand(nheads).to(device),
                D=randn(nheads), chunk_size=64, headdim=headdim, ngroups=ngroups, rmsnorm_weight=randn(dim),
                rmsnorm_eps=1e-5, outproj_weight=randn(24, dim + d_nonssm, scale=0.1), outproj_bias=randn(24),
                norm_before_gate=rng.random() < 0.5)


MIXER_OPTIONS = {"rmsnorm_eps": [-1.0, float("nan"), "1e-5"], "ngroups": [True, 3, 0], "headdim": [0, True, "16"],
                 "norm_before_gate": ["no", 1]}


def _serving_case(rng, device):
    """-> (op name, its kwargs, the names of its in-place buffers)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])

    def randn(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)
    batch, slots = rng.randint(1, 6), rng.randint(6, 9)
    indices = torch.tensor(rng.sample(range(slots), batch), dtype=torch.int32)
    indices[torch.rand(batch, generator=g) < 0.2] = -1                            # padding rows
    op = rng.choice(["selective_state_update", "causal_conv1d_update", "causal_conv1d_fn"])
    if op == "selective_state_update":
        heads, groups, head, state = 4, rng.choice([1, 2]), rng.choice([16, 64]), rng.choice([16, 128])
        kw = dict(state=randn(slots, heads, head, state, dt=torch.float32), x=randn(batch, heads, head),
                  dt=randn(batch, heads, head, scale=0.5), A=-torch.rand(heads, head, state, generator=g).to(device),
                  B=randn(batch, groups, state), C=randn(batch, groups, state), D=randn(heads, head),
                  dt_bias=randn(heads, head, scale=0.3), dt_softplus=True, state_batch_indices=indices.to(device))
        return op, kw, ("state",)
    dim, width = rng.choice([32, 160]), rng.choice([2, 3, 4])
    weight, bias = randn(dim, width), randn(dim)
    if op == "causal_conv1d_update":
        kw = dict(x=randn(batch, dim), conv_state=randn(slots, dim, width - 1 + rng.randint(0, 2)), weight=weight,
                  bias=bias, activation="silu", conv_state_indices=indices.to(device))
        return op, kw, ("conv_state",)
    tokens = rng.randint(1, 200)
    cuts = sorted(rng.sample(range(1, tokens), min(tokens - 1, 3))) if tokens > 1 else []
    seq = torch.tensor([[sum(t >= c for c in cuts) for t in range(tokens)]], dtype=torch.int32, device=device)
    kw = dict(x=randn(1, tokens, dim).transpose(1, 2), weight=weight, bias=bias, activation="silu",
              seq_idx=seq if rng.random() < 0.5 else None)
    return op, kw, ()


def check_serving(rng, backend, device):
    import tilegym_mamba2
    op, kw, buffers = _serving_case(rng, device)
    fn = getattr(tilegym_mamba2, op)
    ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    want = fn(**ref_kw, backend="pytorch")
    got = fn(**kw, backend=backend)
    errors = [relative_error(got, want)] + [relative_error(kw[b], ref_kw[b]) for b in buffers]
    dtype = kw["x"].dtype
    return max(errors) <= TOLERANCE[dtype], f"{op}: errors {['%.2e' % e for e in errors]}"


def _broken(rng, kw):
    """One argument of a valid call broken -> (its name, the broken kwargs)."""
    tensors = [k for k, v in kw.items() if isinstance(v, torch.Tensor)]
    name = rng.choice(tensors)
    t = kw[name]
    how = rng.choice(["shape", "dtype", "type"] + (["range"] if not t.is_floating_point() else []))
    if how == "shape":
        broken = t.new_zeros(*t.shape[:-1], t.shape[-1] + rng.randint(1, 3)) if t.ndim else t.new_zeros(2)
    elif how == "dtype":
        broken = t.to(torch.int64 if t.is_floating_point() else torch.float32)
    elif how == "type":
        broken = t.tolist()
    else:
        broken = t.clone()
        broken.view(-1)[0] = 1 << 20 if name.endswith("indices") else -5
    return f"{name} ({how})", dict(kw, **{name: broken})


def check_malformed(rng, backend, device):
    import tilegym_mamba2
    kind = rng.random()
    if kind < 0.4:
        kw, _ = _layer_case(rng, device)
        fn, buffers = tilegym_mamba2.mamba_chunk_scan_combined, ()
    elif kind < 0.7:
        kw, fn, buffers = _mixer_case(rng, device), tilegym_mamba2.mamba_split_conv1d_scan_combined, ()
    else:
        op, kw, buffers = _serving_case(rng, device)
        fn = getattr(tilegym_mamba2, op)
    if fn is tilegym_mamba2.mamba_split_conv1d_scan_combined and rng.random() < 0.3:
        name = rng.choice(sorted(MIXER_OPTIONS))
        what, kw = f"{name} (value)", dict(kw, **{name: rng.choice(MIXER_OPTIONS[name])})
    else:
        what, kw = _broken(rng, kw)
    before = {b: kw[b].clone() for b in buffers if isinstance(kw[b], torch.Tensor)}
    name = what.split(" ")[0]
    try:
        fn(**kw, backend=backend)
    except (ValueError, TypeError) as e:
        changed = [b for b, v in before.items() if not torch.equal(kw[b], v)]
        if changed:
            return False, f"{what}: wrote {changed} before raising"
        # The message names the argument that was broken (or the one it must agree with).
        return re.search(rf"\b{re.escape(name)}\b", str(e)) is not None, f"{what}: {type(e).__name__}: {e}"
    except Exception as e:  # anything else is a crash, not a clear error
        return False, f"{what}: raised {type(e).__name__}: {e}"
    # Some broken shapes and values are still valid calls (a longer state_len, a wider
    # convolution with a long enough state, a padding index): those may run.
    return "shape" in what or "range" in what, f"{what}: accepted"


CHECKS = {"layer": check_layer, "serving": check_serving, "malformed": check_malformed,
          "isolation": check_isolation, "many_sequences": check_many_sequences, "extreme_decay": check_extreme_decay}
# Seeds below 2^31 draw from the first four kinds, as they did when those were all: a seed a failure
# once printed still replays the same case. Seeds from 2^31 on draw from every kind.
FIRST_KINDS = ("isolation", "layer", "malformed", "serving")


def _next_seed(master):
    """The master's next seed as before the later kinds, one in three moved past 2^31 (decided by
    the seed itself, so the master's stream, and every other case of it, is as it was)."""
    case_seed = master.randrange(1 << 31)
    return case_seed | 1 << 31 if random.Random(case_seed).random() < 1 / 3 else case_seed


def _kind(rng, case_seed):
    first = [k for k in FIRST_KINDS if k in CHECKS]
    return rng.choice(sorted(CHECKS) if case_seed >= 1 << 31 or not first else first)


def fuzz(seconds=60.0, seed=None, log=print, cases=None, start=0) -> int:
    """Runs random cases -> the number of failures: ``cases`` cases drawn from the master seed
    ``start`` (the same cases on every machine, however fast), else cases for ``seconds`` of wall
    time; with ``seed``, that one case (what a failure prints). Each failure prints its seed."""
    on_gpu = torch.cuda.is_available()
    backend, device = ("cutile", "cuda") if on_gpu else ("pytorch", "cpu")
    budget = f"{cases} cases from --start {start}" if cases is not None else f"{seconds:g} s"
    log(f"fuzzing the {backend} backend on {device}: " + ("one case" if seed is not None else budget)
        + ("" if on_gpu else " (a GPU runs the same cases on the cutile kernels)"))
    master = random.Random(start if cases is not None else None)
    tried = {name: 0 for name in CHECKS}
    failures = []
    deadline = time.monotonic() + seconds

    def more():
        if seed is not None:
            return not sum(tried.values())
        if cases is not None:
            return sum(tried.values()) < cases
        return time.monotonic() < deadline
    while more():
        case_seed = _next_seed(master) if seed is None else seed
        rng = random.Random(case_seed)
        kind = _kind(rng, case_seed)
        try:
            ok, detail = CHECKS[kind](rng, backend, device)
        except Exception:
            ok, detail = False, traceback.format_exc(limit=3)
        tried[kind] += 1
        if not ok:
            failures.append((kind, case_seed, detail))
            log(f"FAIL {kind} --seed {case_seed}: {detail}")
    log(f"{sum(tried.values())} cases ({', '.join(f'{k} {v}' for k, v in tried.items())}), "
        f"{len(failures)} failures")
    return len(failures)
