"""Problem specs and reproducible sample inputs for tests and benchmarks.

``Mamba2ProblemSpec`` is a drop-in for the spec class of TileGym's own mamba2 test file
(tests/ops/test_mamba2.py): the same positional fields, and ``get_sample_inputs()`` returns
every key that file's forward and backward tests read, under its names and layouts, with
float64 references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import relative_error
from .mamba3 import MAMBA3_ARGS, Mamba3ProblemSpec
from ..core.tensors import expand_groups
from ..core.validation import CHUNK_SIZES
from ..ssd.reference.forward import (
    LOG2E,
    chunk_output_reference,
    chunk_states_reference,
    decay_cumsum_reference,
)

__all__ = ["COTANGENTS", "FORWARD_ARGS", "FORWARD_REFERENCES", "GRADIENT_REFERENCES", "MAMBA3_ARGS", "Mamba2ProblemSpec",
           "Mamba3ProblemSpec", "relative_error",
           "forward_inputs"]

# The keyword arguments of the forward op, in signature order.
FORWARD_ARGS = ("x", "a", "b", "c", "d", "dt", "init_state", "chunk_size")
# What get_sample_inputs adds: cotangents (with_backward), forward references (with_reference),
# gradient references (both).
COTANGENTS = ("dout", "dfinal_state")
FORWARD_REFERENCES = ("out", "final_state", "decay_cumsum", "decay_cumsum_loge", "hiddens", "chunk_states")
GRADIENT_REFERENCES = ("dx", "da", "db", "dc", "dd", "ddt", "dinit_state", "dhiddens")

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
    # dt = softplus(randn + dt_shift): the default keeps dt small, as trained models have it;
    # 0.0 draws dt as TileGym's own test file does (about 0.8, decays of 1-16 per token).
    dt_shift: float = -2.0

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
        if self.chunk_size & (self.chunk_size - 1):  # TileGym's kernels and ours tile by powers of two
            raise ValueError(f"chunk_size must be a power of two (the op takes {CHUNK_SIZES}), got {self.chunk_size!r}")
        for name in ("dtype", "state_dtype"):
            value = getattr(self, name)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(f"{name} must be a floating-point torch.dtype, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if isinstance(self.dt_shift, bool) or not isinstance(self.dt_shift, (int, float)) or not math.isfinite(
                self.dt_shift):
            raise ValueError(f"dt_shift must be a finite number, got {self.dt_shift!r}")

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
        if len(tuple(shape)) != 6:
            raise ValueError(f"shape must be six sizes (batch, tokens, groups, heads, state_size, head_size), got "
                             f"{tuple(shape)!r}")
        batch, tokens, groups, heads, state_size, head_size = shape
        return cls(batch_size=batch, num_tokens=tokens, num_groups=groups, num_heads=heads,
                   state_size=state_size, head_size=head_size, **fields)

    @property
    def num_chunks(self) -> int:
        return -(-self.num_tokens // self.chunk_size)

    def get_sample_inputs(self, *, with_reference: bool = True, with_backward: bool = True) -> dict:
        """Random inputs (and optionally references and cotangents) on ``self.device``.

        Always: x, a, b, c, d, dt, init_state, chunk_size, so ``op(**inputs)`` works
        (``forward_inputs`` keeps just those). ``with_backward`` adds the cotangents ``dout``
        [B, T, H, P] in ``dtype`` and ``dfinal_state`` [B, H, P, N] fp32.

        ``with_reference`` adds float64 references computed from the inputs exactly as they
        were cast to ``dtype``, under the names and layouts of TileGym's mamba2 test file:

        * ``out`` [B, T, H, P], ``final_state`` [B, H, P, N];
        * ``hiddens`` [B, H, K, P, N], the state entering each chunk (also as ``chunk_states``);
        * ``decay_cumsum`` [B, T, H]: the cumsum of a*dt restarting every chunk, in base 2
          (times log2(e)), and ``decay_cumsum_loge`` [B, T, H], the same in base e. (Before,
          ``decay_cumsum`` was [B, H, K * L], the kernels' padded layout; it follows TileGym's
          meaning now. ``reference.decay_cumsum_reference`` still gives the padded layout.)

        With both flags, gradient references of L = <dout, out> + <dfinal_state, final_state>,
        by float64 autograd through reference.py's chunked stages:

        * ``dx`` [B, T, H, P], ``da`` [H], ``dd`` [H], ``ddt`` [B, T, H] (dt as passed, after
          softplus), ``dinit_state`` [B, H, P, N];
        * ``db``, ``dc`` [B, T, H, N], per head: before the sum over the heads of a group, as
          TileGym's test has them (the gradient of b is ``db.unflatten(2, (G, H // G)).sum(3)``);
        * ``dhiddens`` [B, H, K, P, N]: the gradient of the state leaving each chunk (the one
          entering chunk k + 1; for the last chunk, ``final_state``, so it is ``dfinal_state``).

        TileGym's spec also returns its own backward algorithm's intermediate partial sums
        (``dcb``, ``ddt_partial``, ``ddecay_cumsum_partial``); its tests do not read them, and
        they are not gradients of anything, so they are not offered here.
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
            dt = F.softplus(randn(B, num_tokens, H) + self.dt_shift)
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
        if with_reference and with_backward:
            inputs.update(self._gradient_references(inputs))
        return inputs

    def _references(self, inputs: dict) -> dict:
        x, b, c, d, dt = (inputs[k] for k in ("x", "b", "c", "d", "dt"))
        L, T = self.chunk_size, self.num_tokens
        g = decay_cumsum_reference(inputs["a"], dt, L)
        states, final_state = chunk_states_reference(x, b, dt, g, inputs["init_state"], L)
        out = chunk_output_reference(x, b, c, d, dt, g, states, L)
        per_token = g[:, :, :T].transpose(1, 2).contiguous()  # [B, H, K * L] -> [B, T, H]
        return {"out": out, "final_state": final_state, "decay_cumsum": per_token,
                "decay_cumsum_loge": per_token / LOG2E, "hiddens": states, "chunk_states": states}

    def _gradient_references(self, inputs: dict) -> dict:
        """Float64 autograd through the chunked stages, one chunk at a time, so that the state
        handed from chunk to chunk is a tensor to differentiate against (dhiddens)."""
        f64, L, T, H = torch.float64, self.chunk_size, self.num_tokens, self.num_heads

        def leaf(t):
            return t.detach().to(f64, copy=True).requires_grad_()

        with torch.enable_grad():  # TileGym's tests call get_sample_inputs under torch.no_grad()
            x, a, d, dt, init = (leaf(inputs[k]) for k in ("x", "a", "d", "dt", "init_state"))
            # Per-head copies of b and c (a group per head), so their gradients come per head.
            b = leaf(expand_groups(inputs["b"].to(f64), H).contiguous())
            c = leaf(expand_groups(inputs["c"].to(f64), H).contiguous())
            state, outs, leaving = init, [], []
            for start in range(0, T, L):
                part = slice(start, min(start + L, T))
                g = decay_cumsum_reference(a, dt[:, part], L)
                outs.append(chunk_output_reference(x[:, part], b[:, part], c[:, part], d, dt[:, part], g,
                                                   state[:, :, None], L))
                _, state = chunk_states_reference(x[:, part], b[:, part], dt[:, part], g, state, L)
                leaving.append(state)
            dfinal = inputs["dfinal_state"].to(f64)
            grads = torch.autograd.grad(
                (torch.cat(outs, dim=1), state), (x, a, b, c, d, dt, init, *leaving[:-1]),
                grad_outputs=(inputs["dout"].to(f64), dfinal))
        dx, da, db, dc, dd, ddt, dinit = grads[:7]
        # The state leaving the last chunk is final_state: its gradient is dfinal_state.
        dhiddens = torch.stack([*grads[7:], dfinal], dim=2)
        return {"dx": dx, "da": da, "db": db, "dc": dc, "dd": dd, "ddt": ddt, "dinit_state": dinit,
                "dhiddens": dhiddens}
