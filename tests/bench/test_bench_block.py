"""The block's training-step bench (bench/block.py) on the CPU: ours (the pytorch backend there) runs
a tiny block packed and unpacked, every leaf gets a gradient, and the floor counts the step's bytes."""
import torch

from tilegym_mamba2.bench.block import BLOCK_CASES, TRAINED, BlockCase, block_inputs, floor_bytes, ours, \
    run_block_bench, training_step
from tilegym_mamba2.bench.layer import layer_table

TINY = [BlockCase("tiny", 1, 40, 32, 4, head_dim=8, state_size=8), BlockCase("tiny packed", 1, 40, 32, 4, head_dim=8,
                                                                              state_size=8, sequences=3)]


def test_the_bench_times_ours_on_each_case():
    timed = []

    def timer(fn):
        out = fn()
        assert torch.isfinite(out).all()
        timed.append(out.shape)
        return 1.0
    rows = run_block_bench(TINY, log=lambda *a: None, device="cpu", timer=timer)
    assert [(row["case"], row["impl"]) for row in rows] == [("tiny", "ours"), ("tiny packed", "ours")]
    assert timed == [torch.Size([1, 40, 32])] * 2
    assert "| tiny | 1.000 | — | — |" in layer_table(rows)


def test_every_leaf_gets_a_gradient():
    case = TINY[1]
    args, seq_idx, dout = block_inputs(case, "cpu", torch.float32)
    assert seq_idx is not None and int(seq_idx.max()) == 2
    out = ours(case)(args, seq_idx)
    grads = torch.autograd.grad(out, [args[name] for name in TRAINED], dout)
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert torch.equal(training_step(ours(case))(args, seq_idx, dout), out.detach())


def test_the_floor_is_the_steps_memory_traffic():
    case = BLOCK_CASES[0]
    activations = case.rows * case.tokens
    assert floor_bytes(case) == 2 * (3 * activations * case.width + 2 * activations * case.d_model
                                     + 3 * case.d_model * case.d_inner)
    assert case.width == 2 * 5120 + 2 * 128 + 80
