"""Which rounding of the forward kernel sets its margin at TileGym's tolerances? (CPU)

    python benchmarks/forward_rounding.py [--seeds 20] [--variants all]

compute_out (ssd/compute_out.py) rounds four mma operands to the input dtype (bf16): the
intra-chunk weights C·Bᵀ ∘ decay ∘ dt, the decayed C, the carried fp32 state, and B weighted for
the state update; the output is stored in bf16. This script replays that walk in float64 on the
CPU with those roundings (whole rows, 64-token chunks, as the kernel walks TileGym's short rows),
then with one rounding at a time replaced by a two-term operand (hi + lo, both bf16: what a second
mma per product would cost), or as fp16 (``--variants``), and prints for each variant the worst |error| / allowed over TileGym's
9 shapes plus state 256, ``--seeds`` seeds and both dt draws, for out (atol = rtol = 2e-2) and
final_state (1e-2), against Mamba2ProblemSpec's float64 references.

The replay is a model of the kernel, not the kernel: its figures say which rounding binds, and
the kernel's own margin comes from the GPU tests (tests/test_backward_gpu.py logs the backward's;
benchmarks/tilegym_upstream.py the forward's).
"""
import argparse
import math

import torch

from tilegym_mamba2.testing import Mamba2ProblemSpec

# TileGym's mamba2 test shapes (batch, tokens, groups, heads, state, head, chunk), and state 256
SHAPES = [(1, 64, 1, 4, 16, 32, 64), (2, 128, 1, 4, 16, 32, 64), (1, 64, 2, 4, 16, 32, 64),
          (2, 128, 2, 8, 32, 64, 64), (1, 192, 1, 4, 16, 32, 64), (2, 256, 2, 8, 64, 64, 64),
          (2, 64, 1, 8, 16, 64, 64), (1, 192, 1, 4, 64, 64, 64), (1, 256, 4, 4, 128, 64, 128),
          (1, 512, 1, 4, 256, 64, 128)]
TOLERANCE = {"out": (2e-2, 2e-2), "final_state": (1e-2, 1e-2)}
OPERANDS = ("weights", "c_decayed", "state", "weighted_b")
KERNEL_CHUNK = 64


def rounded(t, form="bf16"):
    """t as handed to an mma: bf16 (the kernel), "2bf16" (hi + lo, two bf16 terms: a second mma),
    "fp16" (3 more mantissa bits at the same cost, where the values fit its range) or "fp64" (as is)."""
    if form == "fp64":
        return t.double()
    if form == "fp16":
        return t.to(torch.float16).double()
    hi = t.to(torch.bfloat16).double()
    return hi + (t - hi).to(torch.bfloat16).double() if form == "2bf16" else hi


def replay(x, a, b, c, d, dt, init_state, forms=None):
    """out [B, T, H, P] (rounded to bf16) and final_state [B, H, P, N], walking 64-token chunks
    with the kernel's roundings; ``forms``: operand name -> its form in ``rounded`` (default bf16)."""
    forms = forms or {}
    x, b, c, dt = x.double(), b.double(), c.double(), dt.double()
    batch, tokens, heads, head = x.shape
    groups = b.shape[2]
    state = init_state.double().clone() if init_state is not None else \
        x.new_zeros(batch, heads, head, b.shape[3])
    out = torch.empty_like(x)
    log2e = 1 / math.log(2)
    for start in range(0, tokens, KERNEL_CHUNK):
        sl = slice(start, min(start + KERNEL_CHUNK, tokens))
        xs, dts = x[:, sl], dt[:, sl]                                     # [B, L, H, P], [B, L, H]
        bs = b[:, sl].repeat_interleave(heads // groups, dim=2)           # [B, L, H, N]
        cs = c[:, sl].repeat_interleave(heads // groups, dim=2)
        g = torch.cumsum(dts * a.double() * log2e, dim=1)                 # base-2 decay sums
        g_last = g[:, -1:]
        scores = torch.einsum("blhn,bshn->bhls", rounded(cs), rounded(bs))
        length = xs.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        gh = g.permute(0, 2, 1)                                           # [B, H, L]
        decay = torch.where(causal, torch.exp2(gh[..., :, None] - gh[..., None, :]), 0.0)
        weights = rounded(scores * decay * dts.permute(0, 2, 1)[:, :, None, :], forms.get("weights", "bf16"))
        y = torch.einsum("bhls,bshp->blhp", weights, xs)
        c_decayed = rounded(cs * torch.exp2(g)[..., None], forms.get("c_decayed", "bf16"))
        y = y + torch.einsum("blhn,bhpn->blhp", c_decayed, rounded(state, forms.get("state", "bf16")))
        y = y + d.double()[None, None, :, None] * xs
        out[:, sl] = y.to(torch.bfloat16).double()
        later = dts * torch.exp2(g_last - g)                              # [B, L, H]
        weighted_b = rounded(bs * later[..., None], forms.get("weighted_b", "bf16"))
        state = state * torch.exp2(g_last)[:, 0, :, None, None] + torch.einsum("blhp,blhn->bhpn", xs, weighted_b)
    return out, state


def worst_ratio(got, ref, atol, rtol):
    ratio = (got - ref.double()).abs() / (atol + rtol * ref.double().abs())
    return torch.where(torch.isfinite(ratio), ratio, torch.inf).max().item()


def main(seeds, variants):
    print(f"worst |error| / allowed, {len(SHAPES)} shapes x {seeds} seeds x 2 dt draws (above 1 fails)")
    print(f"{'operands changed':>24} | {'out':>6} | {'final_state':>11} | worst shape (out)")
    for forms in variants:
        worst = {"out": (0.0, None), "final_state": (0.0, None)}
        for shape in SHAPES:
            batch, tokens, groups, heads, state, head, chunk = shape
            for seed in range(seeds):
                for dt_shift in (0.0, -2.0):
                    spec = Mamba2ProblemSpec(batch, tokens, groups, heads, state, head, chunk, torch.bfloat16,
                                             torch.float32, device="cpu", seed=seed, dt_shift=dt_shift)
                    r = spec.get_sample_inputs(with_backward=False)
                    out, final = replay(r["x"], r["a"], r["b"], r["c"], r["d"], r["dt"], r["init_state"], forms)
                    for name, got in (("out", out), ("final_state", final)):
                        ratio = worst_ratio(got, r[name], *TOLERANCE[name])
                        if ratio > worst[name][0]:
                            worst[name] = (ratio, (shape, seed, dt_shift))
        label = ",".join(f"{k}={v}" for k, v in forms.items()) or "none (the kernel)"
        print(f"{label:>24} | {worst['out'][0]:6.3f} | {worst['final_state'][0]:11.3f} | {worst['out'][1]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--variants", default="all",
                        help="all (each operand as 2bf16, then all four), or one variant: OPERAND=FORM,... "
                             "(FORM: 2bf16 or fp16)")
    args = parser.parse_args()
    if args.variants == "all":
        chosen = [{}] + [{name: "2bf16"} for name in OPERANDS] + [dict.fromkeys(OPERANDS, "2bf16")]
    else:
        chosen = [{}, dict(part.split("=") for part in args.variants.split(","))]
    main(args.seeds, chosen)
