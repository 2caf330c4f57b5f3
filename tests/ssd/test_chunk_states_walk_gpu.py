"""The chunk-state walk (ssd/chunk_states_walk.py) on a GPU: forwards it must give the state
pass's bits at one chunk per segment; backwards (the scan of dh on unflipped dy, c) the float64
scan on flipped inputs; both with packed sequences too. Outputs start as NaN, inputs are fresh
random draws."""
from dataclasses import replace

import pytest
import torch

from tilegym_mamba2.backends.pytorch import pytorch_kernels
from tilegym_mamba2.ssd.backward import _flipped_scan
from tilegym_mamba2.ssd.fwd_pass_state import fwd_pass_state
from tilegym_mamba2.runtime.launch import poisoned_outputs
from tilegym_mamba2.ssd.scans import reversed_scan, scan
from tilegym_mamba2.runtime.tuning import choose_config

from gpu_checks import fresh_seed, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [
    # batch, tokens, groups, heads, state, head, dtype
    (1, 1, 1, 4, 128, 64, torch.bfloat16),
    (2, 1000, 2, 8, 128, 64, torch.bfloat16),
    (4, 4096, 1, 8, 128, 64, torch.bfloat16),      # source config's rows: 64 x 32 tiles
    (1, 2048, 1, 80, 128, 64, torch.bfloat16),     # 2.7B layer's heads: 64 x 64 tiles
    (1, 300, 1, 4, 256, 128, torch.float16),
    (2, 200, 2, 4, 16, 32, torch.float32),
]


def draw(batch, tokens, groups, heads, state, head, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    x, dy = randn(batch, tokens, heads, head).to(dtype), randn(batch, tokens, heads, head).to(dtype)
    b, c = (randn(batch, tokens, groups, state).to(dtype) for _ in range(2))
    dt = torch.nn.functional.softplus(randn(batch, tokens, heads) - 1)
    a = -torch.rand(heads, device="cuda", generator=g) * 4
    return x, dy, b, c, dt, a * dt, randn(batch, heads, head, state), randn(batch, heads, head, state)


def packed_sequences(batch, tokens):
    """seq_idx [batch, tokens] int32: sequences starting inside a chunk, at a chunk's first token
    and one token long where the tokens allow; row 1 starts at sequence 1, so that the row's
    initial state is dropped (mamba_ssm's rule: it belongs to sequence 0)."""
    cuts = torch.tensor(sorted({tokens // 3, tokens // 3 + 1, 64, tokens - 1} - {0}), device="cuda")
    seq = (torch.arange(tokens, device="cuda")[:, None] >= cuts[None, :]).sum(1).to(torch.int32)
    return torch.stack([seq + (row == 1) for row in range(batch)]).contiguous()


def as_reference(entry_states, heads, state, head):
    """[batch, heads, chunks * state, head] -> [batch, chunks, heads, head, state]."""
    batch = entry_states.shape[0]
    return entry_states.view(batch, heads, -1, state, head).permute(0, 2, 1, 4, 3)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_init", [True, False])
@pytest.mark.parametrize("batch,tokens,groups,heads,state,head,dtype", CASES)
def test_forward_walk_gives_the_state_pass_bits(batch, tokens, groups, heads, state, head, dtype, with_init, packed):
    seed = fresh_seed()
    x, _, b, _, dt, log_decay, init, _ = draw(batch, tokens, groups, heads, state, head, dtype, seed)
    init = init if with_init else None
    seq = packed_sequences(batch, tokens) if packed else None
    with poisoned_outputs():
        _, final, _, (entry, decay_cumsum, weight_bht) = scan(x, b, b, dt, log_decay, init, seq, outputs=False)
        config = replace(choose_config(batch, tokens, groups, heads, head, state, 64, x.device), chunks_per_segment=1)
        want_entry, want_final = fwd_pass_state(x, b, weight_bht, decay_cumsum, init, 64, config, seq_idx=seq)
    assert not entry.isnan().any() and not final.isnan().any(), f"seed={seed}: an unwritten state"
    # The walk stores its entry states in x's dtype (half fp32's bytes): the state pass's, rounded once.
    assert entry.dtype == x.dtype, f"entry states in {entry.dtype}, not x's dtype {x.dtype}"
    assert torch.equal(entry, want_entry.to(x.dtype)) and torch.equal(final, want_final), f"seed={seed}"


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_dfinal", [True, False])
@pytest.mark.parametrize("batch,tokens,groups,heads,state,head,dtype", CASES)
def test_reverse_walk_matches_the_flipped_scan_in_float64(batch, tokens, groups, heads, state, head, dtype,
                                                          with_dfinal, packed):
    seed = fresh_seed()
    x, dy, b, c, dt, log_decay, _, dfinal = draw(batch, tokens, groups, heads, state, head, dtype, seed)
    dfinal = dfinal if with_dfinal else None
    seq = packed_sequences(batch, tokens) if packed else None
    with poisoned_outputs():
        forward_states = scan(x, b, c, dt, log_decay, None, seq, outputs=False)[3]
        _, dh_first, _, (entry,) = reversed_scan(dy, c, forward_states, dfinal, seq)
    f64 = torch.float64
    _, want_first, _, (want_entry, _, _) = _flipped_scan(
        pytorch_kernels(f64), dy.to(f64), b.to(f64), c.to(f64), log_decay.to(f64),
        None if dfinal is None else dfinal.to(f64), seq, None, False)
    where = f"seed={seed} {batch, tokens, groups, heads, state, head, dtype} packed={packed}"
    # Operands rounded to x's dtype, as the state pass rounds them (fp32: tf32-level products).
    tolerance = 2e-2 if dtype != torch.float32 else 5e-3
    assert rel_err(as_reference(entry, heads, state, head), want_entry) < tolerance, where
    assert rel_err(dh_first, want_first) < tolerance, where
