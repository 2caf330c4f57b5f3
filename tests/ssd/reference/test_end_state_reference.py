"""reference/end_state.py: a slice's last sequence's end state, against the scan of that
sequence alone (reference/scan.py) in float64."""
import torch

from tilegym_mamba2.ssd.reference.end_state import decay_after, end_state_reference, run_mask
from tilegym_mamba2.ssd.reference.scans import scan_reference

F64 = torch.float64


def _inputs(batch=2, tokens=37, groups=2, heads=4, head_size=8, state=6):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(batch, tokens, heads, head_size, generator=g, dtype=F64)
    B = torch.randn(batch, tokens, groups, state, generator=g, dtype=F64)
    dt = torch.rand(batch, tokens, heads, generator=g, dtype=F64)
    log_decay = -dt * (torch.rand(heads, generator=g, dtype=F64) + 0.5)
    start = torch.randn(batch, heads, head_size, state, generator=g, dtype=F64)
    return x, B, dt, log_decay, start


def test_equals_the_scan_of_the_last_sequence_alone():
    x, B, dt, log_decay, start = _inputs()
    starts = [10, 0]
    got = end_state_reference(x, B, dt, log_decay, starts, start)
    for row, s in enumerate(starts):
        part = slice(row, row + 1), slice(s, None)
        _, want, _ = scan_reference(x[part], B[part], B[part], dt[part], log_decay[part], start[row:row + 1],
                                    chunk_size=16, dtype=F64)
        torch.testing.assert_close(got[row], want[0], rtol=1e-12, atol=1e-12)


def test_decay_after_is_the_decay_from_after_each_token_to_the_end():
    _, _, _, log_decay, _ = _inputs(tokens=9)
    inside = run_mask([3, 0], 9, "cpu")
    after = decay_after(log_decay, inside)                    # [batch, heads, tokens]
    assert (after[0, :, :3] == 0).all()
    want = torch.exp(log_decay[1, 5:].sum(0))                 # after token 4: tokens 5..8
    torch.testing.assert_close(after[1, :, 4], want)
    torch.testing.assert_close(after[:, :, -1], torch.ones_like(after[:, :, -1]))


def test_tokens_before_the_run_reach_neither_the_state_nor_the_gradients():
    x, B, dt, log_decay, start = _inputs()
    x[0, :10], B[0, :10], dt[0, :10], log_decay[0, :10] = float("nan"), float("inf"), float("nan"), float("nan")
    leaves = [t.clone().requires_grad_() for t in (x, B, dt, log_decay, start)]
    state = end_state_reference(*leaves[:4], [10, 0], leaves[4])
    state.sum().backward()
    assert torch.isfinite(state[0]).all()
    for leaf in leaves[:4]:
        assert (leaf.grad[0, :10] == 0).all() and torch.isfinite(leaf.grad[0]).all()
