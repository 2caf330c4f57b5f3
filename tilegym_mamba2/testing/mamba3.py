"""Mamba3ProblemSpec: sizes, seed and options of one Mamba-3 scan problem; its sample inputs carry the
float64 reference (mamba3/reference.py), for the op's tests and for a future kernel's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..mamba3.reference import token_recurrence

MAMBA3_ARGS = ("x", "dt", "A", "B", "C", "trap", "angles", "D", "initial_state")


@dataclass(frozen=True)
class Mamba3ProblemSpec:
    """``rank=None``: single input, single output; an int: MIMO of that rank. ``trapezoid=False``
    gives trap None (Mamba-2's rule), ``rotary=False`` no angles."""

    batch_size: int
    num_tokens: int
    num_groups: int
    num_heads: int
    state_size: int
    head_size: int
    rank: int | None = None
    trapezoid: bool = True
    rotary: bool = True
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_tokens", "num_groups", "num_heads", "state_size", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0):
            raise ValueError(f"rank must be None or a positive int, got {self.rank!r}")
        if self.num_heads % self.num_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_groups ({self.num_groups})")
        if self.rotary and self.state_size % 2:
            raise ValueError(f"rotary states rotate pairs: state_size must be even, got {self.state_size}")

    def get_sample_inputs(self, *, with_reference: bool = True) -> dict:
        """x, dt, A, B, C, trap, angles, D, initial_state (``op(**inputs)`` works), and with
        ``with_reference`` the float64 ``out`` and ``final_state`` of the inputs as cast."""
        Bt, T, G, H, N, P = (self.batch_size, self.num_tokens, self.num_groups, self.num_heads, self.state_size,
                             self.head_size)
        gen = torch.Generator().manual_seed(self.seed)

        def randn(*shape):
            return torch.randn(shape, generator=gen)

        ranks = () if self.rank is None else (self.rank,)
        inputs = {
            "x": F.silu(randn(Bt, T, H, *ranks, P)),
            "dt": F.softplus(randn(Bt, T, H) - 2.0),
            "A": -(1 + 15 * torch.rand(H, generator=gen)),
            "B": randn(Bt, T, G, *ranks, N) / N ** 0.5,
            "C": randn(Bt, T, G, *ranks, N) / N ** 0.5,
            "trap": torch.rand(Bt, T, H, generator=gen) if self.trapezoid else None,
            "angles": randn(Bt, T, H, N // 2) if self.rotary else None,
            "D": randn(H),
            "initial_state": randn(Bt, H, P, N) * 0.1,
        }
        cast = {"x": self.dtype, "B": self.dtype, "C": self.dtype}
        inputs = {k: None if v is None else v.to(self.device, cast.get(k, torch.float32)) for k, v in inputs.items()}
        if with_reference:
            inputs["out"], inputs["final_state"] = token_recurrence(*(inputs[k] for k in MAMBA3_ARGS))
        return inputs
