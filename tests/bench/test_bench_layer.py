"""The layer benchmark's inputs, reference and table on the CPU (timing needs a GPU)."""
import torch

import tilegym_mamba2
from tilegym_mamba2.bench.layer import LAYER_CASES, LayerCase, _reference, layer_inputs, layer_table


def test_cases_cover_rows_and_packed_batches():
    assert any(c.sequences > 1 for c in LAYER_CASES) and any(c.rows > 1 for c in LAYER_CASES)
    assert any(c.heads == 80 for c in LAYER_CASES)  # the 2.7B layer


def test_packed_inputs_are_valid_and_the_reference_matches_the_pytorch_backend():
    case = LayerCase("tiny packed", 1, 300, 1, 4, 16, 16, sequences=5)
    args, lengths = layer_inputs(case, device="cpu", dtype=torch.float32)
    assert sum(lengths) == 300 and len(lengths) == 5 and min(lengths) >= 1
    assert args["cu_seqlens"].tolist()[-1] == 300
    out, varlen = tilegym_mamba2.mamba_chunk_scan_combined(**args, chunk_size=64, backend="pytorch")
    assert varlen.shape[0] == 5
    ref = _reference(args, 64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_reference_is_for_the_first_row():
    case = LayerCase("tiny rows", 2, 100, 1, 4, 16, 16)
    args, _ = layer_inputs(case, device="cpu", dtype=torch.float32)
    out = tilegym_mamba2.mamba_chunk_scan_combined(**args, chunk_size=32, backend="pytorch")
    ref = _reference(args, 32)
    assert ref.shape[0] == 1 and ((out[:1].double() - ref).norm() / ref.norm()).item() < 1e-5


def test_table_gives_the_ratio():
    rows = [dict(case="a", impl="ours", ms=0.2), dict(case="a", impl="mamba_ssm", ms=0.5),
            dict(case="b", impl="ours", ms=0.1)]
    lines = layer_table(rows).splitlines()
    assert "2.50x" in lines[2] and "—" in lines[3]


def test_training_step_takes_every_gradient_of_the_output():
    """bench --layer --backward's step: the output's backward reaches every differentiable input
    (here on the pytorch backend), and the step returns the forward's output."""
    from tilegym_mamba2.bench.layer import TRAINED, _training_step, training_args
    case = LayerCase("tiny packed", 1, 120, 1, 4, 16, 16, sequences=3)
    args, _ = layer_inputs(case, device="cpu", dtype=torch.float32)
    train = training_args(args)
    assert all(train[k].requires_grad for k in TRAINED) and train["dout"].shape == args["x"].shape
    seen, grads = {}, {}
    for k in TRAINED:
        train[k].register_hook(lambda g, k=k: grads.setdefault(k, g))

    def call(a, chunk):
        result = tilegym_mamba2.mamba_chunk_scan_combined(**a, chunk_size=chunk, backend="pytorch")
        seen["out"] = result[0]
        return result
    out = _training_step(call)(train, 32)
    assert not out.requires_grad and torch.equal(out, seen["out"].detach())
    assert sorted(grads) == sorted(TRAINED)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
