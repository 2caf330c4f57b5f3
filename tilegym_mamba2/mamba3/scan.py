"""mamba3_scan, the pytorch backend: the arguments checked, then reference.py's recurrence in
float32 (float64 for float64 x). A token loop: the definition run for its results, not a kernel."""
from __future__ import annotations

import torch

from ..core.constants import REFERENCE_INPUT_DTYPES
from ..core.validation import check_one_device, dtype_names, expect_float, expect_rank, expect_shape, expect_tensor
from ..runtime.limits import PYTORCH
from .reference import token_recurrence


def check_mamba3_args(x, dt, A, B, C, trap=None, angles=None, D=None, initial_state=None):
    """Raises TypeError or ValueError naming the argument at fault; returns (mimo, compute dtype)."""
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        expect_tensor(name, t)
        expect_float(name, t)
    mimo = x.dim() == 5
    layout = "[batch, tokens, heads, rank, head_size]" if mimo else "[batch, tokens, heads, head_size]"
    if x.dim() not in (4, 5):
        raise ValueError(f"x must be [batch, tokens, heads, head_size] (or with a rank dimension before head_size, "
                         f"MIMO), got shape {tuple(x.shape)}")
    if x.dtype not in REFERENCE_INPUT_DTYPES:
        raise TypeError(f"x must be {dtype_names(REFERENCE_INPUT_DTYPES)}, got {x.dtype}")
    batch, tokens, heads = x.shape[:3]
    rank = x.shape[3] if mimo else None
    if tokens == 0:
        raise ValueError("x must hold at least one token (its dimension 1 is 0)")
    bc_layout = "[batch, tokens, groups, rank, state_size]" if mimo else "[batch, tokens, groups, state_size]"
    for name, t in (("B", B), ("C", C)):
        expect_rank(name, t, bc_layout)
        if tuple(t.shape[:2]) != (batch, tokens) or (mimo and t.shape[3] != rank):
            raise ValueError(f"{name} must be {bc_layout} with x's batch, tokens{' and rank' if mimo else ''} "
                             f"({layout} = {tuple(x.shape)}), got {tuple(t.shape)}")
    if B.shape != C.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    groups, state_size = B.shape[2], B.shape[-1]
    if heads % groups:
        raise ValueError(f"heads ({heads}, x's dimension 2) must be a multiple of groups ({groups}, B's dimension 2)")
    expect_shape("dt", dt, (batch, tokens, heads), "[batch, tokens, heads]")
    expect_shape("A", A, (heads,), "[heads]")
    if trap is not None:
        expect_tensor("trap", trap)
        expect_float("trap", trap)
        expect_shape("trap", trap, (batch, tokens, heads), "[batch, tokens, heads]")
    if angles is not None:
        expect_tensor("angles", angles)
        expect_float("angles", angles)
        if state_size % 2:
            raise ValueError(f"angles rotate pairs of state dimensions: state_size (B's last dimension) must be "
                             f"even, got {state_size}")
        expect_shape("angles", angles, (batch, tokens, heads, state_size // 2), "[batch, tokens, heads, state_size / 2]")
    if D is not None:
        expect_tensor("D", D)
        expect_float("D", D)
        expect_shape("D", D, (heads,), "[heads]")
    if initial_state is not None:
        expect_tensor("initial_state", initial_state)
        expect_float("initial_state", initial_state)
        expect_shape("initial_state", initial_state, (batch, heads, x.shape[-1], state_size),
                     "[batch, heads, head_size, state_size]")
    check_one_device({"x": x, "dt": dt, "A": A, "B": B, "C": C, "trap": trap, "angles": angles, "D": D,
                      "initial_state": initial_state}, PYTORCH)
    return mimo, torch.float64 if x.dtype == torch.float64 else torch.float32


def mamba3_scan_pytorch(x, dt, A, B, C, trap=None, angles=None, D=None, initial_state=None):
    """-> (out like x in x's dtype, final_state [batch, heads, head_size, state_size] fp32 (float64 for
    float64 x)). Differentiable through torch's autograd."""
    _, dtype = check_mamba3_args(x, dt, A, B, C, trap, angles, D, initial_state)
    out, final_state = token_recurrence(x, dt, A, B, C, trap, angles, D, initial_state, dtype=dtype)
    return out.to(x.dtype), final_state
