"""The kernels' worst elementwise margin at TileGym's tolerances, forward and backward (GPU).

    python benchmarks/margins.py [--seeds 20] [--first-seed 0] [--backend cutile]

For TileGym's 9 mamba2 test shapes plus state 256 (benchmarks/forward_rounding.py's SHAPES),
seeds ``--first-seed`` on, and both dt draws (TileGym's, and dt_shift -2: slow decays, long sums),
it calls ``mamba2_chunk_forward`` and ``mamba2_chunk_backward`` on Mamba2ProblemSpec's bf16 inputs
(drawn on the CPU, so a seed is the GPU tests' and the replays' case) and measures, for out,
final_state and every gradient, |ours - float64 reference| / (atol + rtol |reference|) at
TileGym's tolerances (above 1 fails; NaN counts as infinite), db and dc summed over each group's
heads. It prints each case with a ratio above 1, then the worst ratio of each and the case that
gave it, a case as ``B,T,G,H,N,P,CHUNK:SEED:DT_SHIFT`` (the replays' ``--case``). The replays
(forward_rounding.py, backward_rounding.py) model these kernels on the CPU; this measures them.
"""
import argparse

import torch

from backward_rounding import TOLERANCE as BACKWARD_TOLERANCE  # benchmarks/backward_rounding.py
from forward_rounding import SHAPES, TOLERANCE as FORWARD_TOLERANCE, worst_ratio
import tilegym_mamba2
from tilegym_mamba2.testing import Mamba2ProblemSpec

TOLERANCE = {**FORWARD_TOLERANCE, **BACKWARD_TOLERANCE, "dd": (1e-2, 1e-2)}
FORWARD = ("out", "final_state")
BACKWARD = ("dx", "da", "db", "dc", "dd", "ddt", "dinit_state")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the pytorch backend only
INPUTS = ("x", "a", "b", "c", "d", "dt", "init_state")


def case_ratios(shape, seed, dt_shift, backend):
    """{output or gradient: worst ratio} of one case."""
    batch, tokens, groups, heads = shape[:4]
    spec = Mamba2ProblemSpec(*shape, torch.bfloat16, torch.float32, device=DEVICE, seed=seed, dt_shift=dt_shift)
    r = spec.get_sample_inputs()
    args = [r[k] for k in INPUTS]
    got = dict(zip(FORWARD, tilegym_mamba2.mamba2_chunk_forward(*args, spec.chunk_size, backend=backend)))
    got.update(zip(BACKWARD, tilegym_mamba2.mamba2_chunk_backward(*args, r["dout"], r["dfinal_state"],
                                                                   spec.chunk_size, backend=backend)))
    out = {}
    for name, value in got.items():
        ref = r[name]
        if name in ("db", "dc"):  # a group's gradient sums its heads'
            ref = ref.view(batch, tokens, groups, heads // groups, -1).sum(3)
        out[name] = worst_ratio(value.double(), ref, *TOLERANCE[name])
    return out


def main(seeds, first_seed, backend):
    names = FORWARD + BACKWARD
    worst = dict.fromkeys(names, (0.0, None))
    cases = [(shape, seed, dt_shift) for shape in SHAPES for seed in range(first_seed, first_seed + seeds)
             for dt_shift in (0.0, -2.0)]
    above = 0
    for shape, seed, dt_shift in cases:
        ratios = case_ratios(shape, seed, dt_shift, backend)
        case = f"{','.join(map(str, shape))}:{seed}:{dt_shift}"
        failing = {name: ratio for name, ratio in ratios.items() if not ratio <= 1}
        if failing:
            above += 1
            print(f"above 1: {case} " + " ".join(f"{name}={ratio:.3f}" for name, ratio in failing.items()), flush=True)
        for name, ratio in ratios.items():
            if not ratio <= worst[name][0]:
                worst[name] = (ratio, case)
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"worst |error| / allowed at TileGym's tolerances, {len(cases)} cases ({len(SHAPES)} shapes x {seeds} "
          f"seeds x 2 dt draws), backend {backend}, {device_name}: {above} cases above 1")
    print("| " + " | ".join(names) + " |")
    print("|" + " --- |" * len(names))
    print("| " + " | ".join(f"{worst[n][0]:.3f}" for n in names) + " |")
    print("worst cases: " + "; ".join(f"{n} {worst[n][1]}" for n in names))
    return above


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--backend", default="cutile")
    args = parser.parse_args()
    raise SystemExit(1 if main(args.seeds, args.first_seed, args.backend) else 0)
