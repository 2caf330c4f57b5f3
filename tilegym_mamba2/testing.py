"""Problem specs and reproducible sample inputs for tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import (
    chunk_output_reference,
    chunk_states_reference,
    decay_cumsum_reference,
)

__all__ = ["FORWARD_ARGS", "Mamba2ProblemSpec", "forward_inputs"]

# The keyword arguments of the forward op, in signature order.
FORWARD_ARGS = ("x", "a", "b", "c", "d", "dt", "init_state", "chunk_size")

_SIZE_FIELDS = ("batch_size", "num_tokens", "num_groups", "num_heads", "state_size", "head_size", "chunk_size")


def forward_inputs(d: dict) -> dict:
    """Keep only the forward op's arguments of a ``get_sample_inputs`` dict."""
    return {k: d[k] for k in FORWARD_ARGS if k in d}


@dataclass(frozen=True)
class Mamba2ProblemSpec:
    """Sizes, dtypes and seed of one Mamba-2 forward problem.

    ``device=None`` resolves to "cuda" when available, else "cpu", and is
    stored as a ``torch.device``.
    """

    batch_size: int
    num_tokens: int
    num_groups: int
    num_heads: int
    state_size: int
    head_size: int
    chunk_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    device: str | torch.device | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            # bool is an int subclass; True as a size is always a mistake.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_groups:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_groups ({self.num_groups})"
            )
        for name in ("dtype", "state_dtype"):
            value = getattr(self, name)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(f"{name} must be a floating-point torch.dtype, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")

        device = self.device
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device is not a valid torch device: {self.device!r}") from exc
        object.__setattr__(self, "device", device)  # frozen: bypass __setattr__ once

    @classmethod
    def from_shape(cls, shape, **fields) -> "Mamba2ProblemSpec":
        """From (batch, tokens, groups, heads, state_size, head_size), the benchmarks' order."""
        batch, tokens, groups, heads, state_size, head_size = shape
        return cls(batch_size=batch, num_tokens=tokens, num_groups=groups, num_heads=heads,
                   state_size=state_size, head_size=head_size, **fields)

    @property
    def num_chunks(self) -> int:
        return -(-self.num_tokens // self.chunk_size)

    def get_sample_inputs(self, *, with_reference: bool = True, with_backward: bool = True) -> dict:
        """Random inputs (and optionally references and cotangents) on ``self.device``.

        Always: x, a, b, c, d, dt, init_state, chunk_size, so ``op(**inputs)``
        works. ``with_backward`` adds ``dout`` and ``dfinal_state``;
        ``with_reference`` adds float64 ``out``, ``final_state``,
        ``decay_cumsum`` and ``chunk_states`` computed from the inputs exactly
        as they were cast to ``dtype``.
        """
        B, T, G, H = self.batch_size, self.num_tokens, self.num_groups, self.num_heads
        N, P, L = self.state_size, self.head_size, self.chunk_size
        # Draw on CPU so the same seed gives the same numbers on every device.
        gen = torch.Generator().manual_seed(self.seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen)

        def tokens(num_tokens: int) -> tuple[torch.Tensor, ...]:
            x = F.silu(randn(B, num_tokens, H, P))
            b = F.silu(randn(B, num_tokens, G, N))
            c = F.silu(randn(B, num_tokens, G, N))
            # Shifted softplus keeps dt small and positive, as trained models do.
            dt = F.softplus(randn(B, num_tokens, H) - 2)
            return x, b, c, dt

        x, b, c, dt = tokens(T)
        a = -(1 + 15 * torch.rand(H, generator=gen))
        d = randn(H)
        # A zero or Gaussian init_state would be out of distribution; run one
        # chunk of random tokens from zero to get a realistic state.
        wx, wb, _, wdt = tokens(L)
        warm_g = decay_cumsum_reference(a, wdt, L)
        _, init_state = chunk_states_reference(wx, wb, wdt, warm_g, None, L)

        dev = self.device
        inputs = {
            "x": x.to(dev, self.dtype),
            "a": a.to(dev),
            "b": b.to(dev, self.dtype),
            "c": c.to(dev, self.dtype),
            "d": d.to(dev),
            "dt": dt.to(dev, self.dtype),
            "init_state": init_state.to(dev, self.state_dtype),
            "chunk_size": L,
        }
        # Cotangents are drawn last so the forward inputs do not depend on the flags.
        if with_backward:
            inputs["dout"] = randn(B, T, H, P).to(dev, self.dtype)
            inputs["dfinal_state"] = randn(B, H, P, N).to(dev, torch.float32)
        if with_reference:
            inputs.update(self._references(inputs))
        return inputs

    def _references(self, inputs: dict) -> dict:
        x, b, c, d, dt = (inputs[k] for k in ("x", "b", "c", "d", "dt"))
        L = self.chunk_size
        g = decay_cumsum_reference(inputs["a"], dt, L)
        states, final_state = chunk_states_reference(x, b, dt, g, inputs["init_state"], L)
        out = chunk_output_reference(x, b, c, d, dt, g, states, L)
        return {"out": out, "final_state": final_state, "decay_cumsum": g, "chunk_states": states}
