"""Which rounding of the backward sets its margin at TileGym's tolerances? (CPU)

    python benchmarks/backward_rounding.py [--seeds 20] [--variants all]

The backward (backward.py on the cutile kernels) rounds where the forward does not: the two
state walks (ssd/chunk_states_walk.py) hand every chunk's entry state S and end gradient dS
to chunk_grads rounded to the input dtype (bf16), and each walk rounds the weighted operand of
its own update (B weighted by dt and the decay forwards, C weighted by the decay backwards). The
chunk's weights go into their mma as two bf16 terms (split_mma), nearly exact, and are replayed
exactly. This script replays the walks and chunk_grads_reference in float64 with those roundings
and prints, per variant, the worst |error| / allowed at TileGym's elementwise tolerances over its 9
shapes plus state 256, ``--seeds`` seeds and both dt draws, for dx, ddt, da, db, dc and dinit_state
(dd takes no state), against Mamba2ProblemSpec's float64 references. The inputs are drawn on the
CPU, so a seed here is the same case as in the GPU tests (``--case`` replays one).

Variants set each rounding point's form: ``states`` (S and dS for chunk_grads) and ``walk`` (the
walks' weighted operands), each bf16 (the kernels), fp16 (3 more mantissa bits), fp16s (fp16
after a power-of-two scale per tile that brings its largest value under 2^14, as a kernel would
store it), fp16r (the same scale per row of a tile: a state index n of a stored state, a token of a
weighted operand), fp32 or fp64. ``--loss-scale`` scales the output gradients as a smaller loss would:
at 2**-24 unscaled fp16 loses the state gradients below its normal range, fp16s does not.

The replay is a model of the kernels, not the kernels: its figures say which rounding binds, and
the kernels' own margins come from the GPU tests (tests/test_backward_gpu.py).
"""
import argparse

import torch

from forward_rounding import SHAPES, worst_ratio  # benchmarks/forward_rounding.py
from tilegym_mamba2.ssd.reference.chunk_grads import chunk_grads_reference
from tilegym_mamba2.testing import Mamba2ProblemSpec

TOLERANCE = {"dx": (4e-2, 4e-2), "da": (1e-2, 1e-2), "db": (5e-2, 4e-2), "dc": (4e-2, 4e-2),
             "ddt": (8e-2, 8e-2), "dinit_state": (1e-2, 1e-2)}
FORMS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def rounded(t, form, tile_dims=(), row_dims=()):
    """t in ``form``; "fp16s": fp16 after a power-of-two scale per tile (``tile_dims``: the dims a
    tile spans) that brings the tile's largest value under 2^14, as a kernel would store it;
    "fp16r": the same per row of a tile (``row_dims``), a maximum found without crossing warps."""
    if form not in ("fp16s", "fp16r"):
        return t.to(FORMS[form]).double()
    largest = t.abs().amax(dim=tile_dims if form == "fp16s" else row_dims, keepdim=True).clamp_min(1e-300)
    scale = torch.exp2(14 - torch.ceil(torch.log2(largest)))
    return (t * scale).to(torch.float16).double() / scale


def chunked(t, chunk):
    """[B, T, ...] -> [B, K, chunk, ...], zero-padded at the end."""
    pad = -t.shape[1] % chunk
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], 1)
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def walks(x, b, c, dy, w, log_decay, init, dfinal, chunk, walk_form):
    """The chunk entry states S [B, K, H, P, N] (forward walk), the end gradients dS (the gradient
    of the state leaving each chunk, reverse walk) and dinit, with the walks' weighted operands in
    ``walk_form``."""
    xc, dyc, wc = chunked(x, chunk), chunked(dy, chunk), chunked(w, chunk)
    bc, cc, lc = chunked(b, chunk), chunked(c, chunk), chunked(log_decay, chunk)
    g = lc.cumsum(2)                                                       # [B, K, L, H], from the chunk's start
    total = g[:, :, -1]                                                    # [B, K, H]
    chunks = xc.shape[1]
    entry, state = [], init
    for k in range(chunks):
        entry.append(state)
        weighted_b = rounded(bc[:, k] * (wc[:, k] * torch.exp(total[:, k, None] - g[:, k]))[..., None], walk_form,
                             (1, 3), (3,))  # a tile: the chunk's tokens x the state, per head; a row: a token
        state = state * torch.exp(total[:, k])[..., None, None] + torch.einsum("blhp,blhn->bhpn", xc[:, k], weighted_b)
    ends, grad = [None] * chunks, dfinal
    for k in reversed(range(chunks)):
        ends[k] = grad
        weighted_c = rounded(cc[:, k] * torch.exp(g[:, k])[..., None], walk_form, (1, 3), (3,))
        grad = grad * torch.exp(total[:, k])[..., None, None] + torch.einsum("blhp,blhn->bhpn", dyc[:, k], weighted_c)
    return torch.stack(entry, 1), torch.stack(ends, 1), grad


def replay(r, chunk, forms):
    """The gradients of a Mamba2ProblemSpec sample as the kernels round them (``forms``)."""
    x, dy, dt = r["x"].double(), r["dout"].double(), r["dt"].double()
    dfinal = r["dfinal_state"].double()
    heads, groups = x.shape[2], r["b"].shape[2]
    b = r["b"].double().repeat_interleave(heads // groups, dim=2)
    c = r["c"].double().repeat_interleave(heads // groups, dim=2)
    a, d = r["a"].double(), r["d"].double()
    log_decay = a * dt
    entry, ends, dinit = walks(x, b, c, dy, dt, log_decay, r["init_state"].double(), dfinal, chunk, forms["walk"])
    # A tile per chunk and head; a row: one state index n over the head's columns (stored [N, P]).
    entry, ends = rounded(entry, forms["states"], (3, 4), (3,)), rounded(ends, forms["states"], (3, 4), (3,))
    dxs, ddt_input, dl, db, dc = chunk_grads_reference(x, r["b"].double(), r["c"].double(), dy, dt, log_decay,
                                                       entry, ends, chunk_size=chunk)
    return {"dx": (dt[..., None] * dxs + d[:, None] * dy).to(torch.bfloat16).double(),
            "ddt": (ddt_input + a * dl).to(torch.bfloat16).double(), "da": (dt * dl).sum((0, 1)),
            "db": db.to(torch.bfloat16).double(), "dc": dc.to(torch.bfloat16).double(), "dinit_state": dinit}


def ratios(shape, seed, dt_shift, forms, loss_scale=1.0):
    """-> {gradient: worst ratio}. ``loss_scale`` scales the output gradients (and so every
    reference gradient and its tolerance) as a loss of another size would."""
    batch, tokens, groups, heads, state, head, chunk = shape
    spec = Mamba2ProblemSpec(batch, tokens, groups, heads, state, head, chunk, torch.bfloat16, torch.float32,
                             device="cpu", seed=seed, dt_shift=dt_shift)
    r = spec.get_sample_inputs()
    r["dout"] = (r["dout"].double() * loss_scale).to(r["dout"].dtype)
    r["dfinal_state"] = r["dfinal_state"] * loss_scale
    got = replay(r, chunk, forms)
    out = {}
    for name, value in got.items():
        value = value / loss_scale
        ref = r[name]
        if name in ("db", "dc"):  # a group's gradient sums its heads'
            ref = ref.view(batch, tokens, groups, heads // groups, -1).sum(3)
        out[name] = worst_ratio(value, ref, *TOLERANCE[name])
    return out


def main(seeds, variants, case, loss_scale):
    cases = [case] if case else [(shape, seed, dt_shift) for shape in SHAPES for seed in range(seeds)
                                 for dt_shift in (0.0, -2.0)]
    print(f"worst |error| / allowed over {len(cases)} cases (above 1 fails), output gradients x {loss_scale:g}")
    print(f"{'states, walk':>12} | " + " | ".join(f"{n:>11}" for n in TOLERANCE))
    worst_cases = []
    for forms in variants:
        worst = dict.fromkeys(TOLERANCE, (0.0, None))
        for shape, seed, dt_shift in cases:
            for name, ratio in ratios(shape, seed, dt_shift, forms, loss_scale).items():
                if ratio > worst[name][0]:
                    worst[name] = (ratio, f"{','.join(map(str, shape))}:{seed}:{dt_shift}")
        label = f"{forms['states']}, {forms['walk']}"
        print(f"{label:>12} | " + " | ".join(f"{worst[n][0]:11.3f}" for n in TOLERANCE), flush=True)
        worst_cases.append((label, worst))
    for label, worst in worst_cases:  # each as --case takes it
        print(f"worst cases, {label}: " + "; ".join(f"{n} {case}" for n, (_, case) in worst.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--variants", default="all",
                        help="all, or STATES,WALK (each bf16, fp16, fp16s, fp16r, fp32 or fp64); the first row is "
                             "always the kernels'")
    parser.add_argument("--case", help="one case: B,T,G,H,N,P,CHUNK:SEED:DT_SHIFT")
    parser.add_argument("--loss-scale", type=float, default=1.0,
                        help="scale the output gradients by this (a power of two keeps dout's bf16 bits): "
                             "2**-24 is a loss of another size, below fp16's normal range")
    args = parser.parse_args()
    kernels = {"states": "bf16", "walk": "bf16"}
    if args.variants == "all":
        chosen = [kernels, {"states": "fp32", "walk": "bf16"}, {"states": "fp16", "walk": "bf16"},
                  {"states": "bf16", "walk": "fp32"}, {"states": "fp16", "walk": "fp16"},
                  {"states": "fp16s", "walk": "fp16s"}, {"states": "fp32", "walk": "fp32"}]
    else:
        states, walk = args.variants.split(",")
        chosen = [kernels, {"states": states, "walk": walk}]
    one = None
    if args.case:
        shape, seed, dt_shift = args.case.split(":")
        one = (tuple(int(v) for v in shape.split(",")), int(seed), float(dt_shift))
    main(args.seeds, chosen, one, args.loss_scale)
