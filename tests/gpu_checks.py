"""Helpers of the GPU tests: fresh seeds and NaN-refusing relative errors."""
import os

import torch


def fresh_seed() -> int:
    """A new seed for every test (failures print theirs); TILEGYM_MAMBA2_SEED replays one."""
    fixed = os.environ.get("TILEGYM_MAMBA2_SEED")
    return int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")


def rel_err(got, ref):
    """‖got − ref‖ / ‖ref‖ in float64; a NaN (an unwritten element or an overflow) fails."""
    got, ref = got.double(), ref.double()
    assert not torch.isnan(got).any(), "NaN in output (an unwritten element or an overflow)"
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
