"""The layer op through autograd on the CPU (pytorch backend): gradients of every input against
float64 autograd of the token recurrence, losses of some outputs only, and checks made once."""
import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.testing import relative_error as rel
from layer_inputs import F64, cu, layer_inputs


def test_layer_autograd_packed_sequences_matches_float64():
    """Packed sequences with their own initial states, and gradients flowing into the final and
    varlen states too (which mamba_ssm's backward refuses)."""
    t = {k: v.float() for k, v in layer_inputs(7, 1, 50, d_per_channel=True, init="sequence", sequences=3).items()}
    cu_seqlens = cu(7, 30, 50)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    kw = dict(leaves)
    out, final, states = tilegym_mamba2.mamba_chunk_scan_combined(
        kw.pop("x"), kw.pop("dt"), kw.pop("A"), kw.pop("B"), kw.pop("C"), 16, **kw, cu_seqlens=cu_seqlens,
        dt_softplus=True, dt_limit=(0.05, 2.0), return_final_states=True, return_varlen_states=True)
    g = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(r.shape, generator=g) for r in (out, final, states)]
    torch.autograd.backward([out, final, states], cotangents)
    r = {k: v.double().requires_grad_() for k, v in t.items()}
    ref = layer_token_recurrence(r["x"], r["dt"], r["A"], r["B"], r["C"], r["D"], r["z"], r["dt_bias"],
                                 r["initial_states"], None, cu_seqlens, True, (0.05, 2.0))
    refs = torch.autograd.grad(sum((o * c.double()).sum() for o, c in zip(ref, cotangents)), list(r.values()))
    for (name, leaf), want in zip(leaves.items(), refs):
        assert rel(leaf.grad, want) < 1e-4, (name, rel(leaf.grad, want))


@pytest.mark.parametrize("used", [("out",), ("final",), ("states",), ("out", "states")])
def test_layer_autograd_loss_of_some_outputs(used, monkeypatch):
    """A loss that leaves outputs out (a training loss is usually the output alone) gets the
    gradients of that loss; varlen states outside it cost no per-sequence edge terms."""
    from tilegym_mamba2.ssd import backward
    t = {k: v.float() for k, v in layer_inputs(5, 1, 50, bias=False).items()}
    cu_seqlens = cu(9, 31, 50)
    if "states" not in used:
        def refuse(*args, **kwargs):
            raise AssertionError("edge terms for varlen states the loss left out")
        monkeypatch.setattr(backward, "sequence_edge_terms", refuse)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    kw = dict(leaves)
    outputs = dict(zip(("out", "final", "states"), tilegym_mamba2.mamba_chunk_scan_combined(
        kw.pop("x"), kw.pop("dt"), kw.pop("A"), kw.pop("B"), kw.pop("C"), 16, **kw, cu_seqlens=cu_seqlens,
        dt_softplus=True, return_final_states=True, return_varlen_states=True)))
    g = torch.Generator().manual_seed(4)
    weights = {name: torch.randn(outputs[name].shape, generator=g) for name in used}
    sum((outputs[name] * w).sum() for name, w in weights.items()).backward()
    r = {k: v.double().requires_grad_() for k, v in t.items()}
    ref = dict(zip(("out", "final", "states"), layer_token_recurrence(
        r["x"], r["dt"], r["A"], r["B"], r["C"], r["D"], r["z"], None, None, None, cu_seqlens, True)))
    refs = torch.autograd.grad(sum((ref[name] * w.double()).sum() for name, w in weights.items()), list(r.values()),
                               allow_unused=True)  # C reaches the outputs alone
    for (name, leaf), want in zip(leaves.items(), refs):
        want = torch.zeros_like(leaf, dtype=F64) if want is None else want
        assert torch.isfinite(leaf.grad).all() and rel(leaf.grad, want) < 1e-4, (name, rel(leaf.grad, want))


def test_layer_autograd_checks_its_arguments_once(monkeypatch):
    """A training step checks the layer op's tensors once, in the forward (a packed call's checks
    read its offsets back from the device, and each read waits for the queued work); the backward
    takes the arguments its forward checked. The public backward op checks them, and both give
    the same gradients: the same bits, but for dz, which autograd takes from the forward's output
    before its gate and the public op from that output computed again (fp32 roundings apart)."""
    from tilegym_mamba2.core import validation
    checks = []
    original = validation._check_packing
    monkeypatch.setattr(validation, "_check_packing", lambda *a: checks.append(1) or original(*a))
    t = {k: v.float() for k, v in layer_inputs(6, 1, 50).items()}
    cu_seqlens = cu(11, 50)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    kw = dict(leaves)
    out = tilegym_mamba2.mamba_chunk_scan_combined(kw.pop("x"), kw.pop("dt"), kw.pop("A"), kw.pop("B"), kw.pop("C"),
                                                   16, **kw, cu_seqlens=cu_seqlens, dt_softplus=True)
    assert checks == [1]
    dout = torch.randn(out.shape)
    out.backward(dout)
    assert checks == [1]
    import tilegym
    args = dict(t)
    explicit = tilegym.ops.mamba2_chunk_scan_combined_backward(
        dout, torch.zeros(1, 4, 6, 8), None, args.pop("x"), args.pop("dt"), args.pop("A"), args.pop("B"),
        args.pop("C"), 16, **args, cu_seqlens=cu_seqlens, dt_softplus=True, backend="pytorch")
    assert checks == [1, 1]
    for (name, leaf), want in zip(leaves.items(), explicit):   # both in the order x, dt, A, B, C, D, z, dt_bias
        if name == "z":
            assert not torch.equal(leaf.grad, torch.zeros_like(want)) and rel(leaf.grad, want) < 1e-6
        else:
            assert torch.equal(leaf.grad, want), name


def test_layer_autograd_all_inputs():
    """Every differentiable input of the layer op gets float64-accurate gradients (fp32 math)."""
    t = {k: v.float() for k, v in layer_inputs(11, 2, 41, init="row").items()}
    seq_idx = torch.tensor([[0] * 20 + [1] * 21, [0] * 41])
    leaves = [v.clone().requires_grad_() for v in t.values()]
    kw = dict(zip(t, leaves))
    out, final = tilegym_mamba2.mamba_chunk_scan_combined(
        kw.pop("x"), kw.pop("dt"), kw.pop("A"), kw.pop("B"), kw.pop("C"), 16, **kw, seq_idx=seq_idx,
        dt_softplus=True, return_final_states=True)
    dout, dfinal = torch.randn(out.shape), torch.randn(final.shape)
    torch.autograd.backward([out, final], [dout, dfinal])
    ref_leaves = [v.double().requires_grad_() for v in t.values()]
    r = dict(zip(t, ref_leaves))
    o, f, _ = layer_token_recurrence(r["x"], r["dt"], r["A"], r["B"], r["C"], r["D"], r["z"], r["dt_bias"],
                                     r["initial_states"], seq_idx, None, True)
    refs = torch.autograd.grad((o * dout.double()).sum() + (f * dfinal.double()).sum(), ref_leaves)
    for name, leaf, ref in zip(t, leaves, refs):
        assert leaf.grad is not None and leaf.grad.dtype == torch.float32, name
        assert rel(leaf.grad, ref) < 1e-4, (name, rel(leaf.grad, ref))


@pytest.mark.parametrize("init", [None, "sequence"])
def test_layer_backward_takes_the_forward_output_before_its_gate(init, monkeypatch):
    """With z, the forward keeps y + D x for the backward's dz (no second forward for it), except
    where packed sequences start from initial states of their own: those join the output after
    the gate, and the backward computes the forward again. Either way dz is float64's."""
    from tilegym_mamba2.ssd import backward
    kept, scans = [], []
    layer_backward, scan_backward = backward.layer_backward, backward.scan_backward
    monkeypatch.setattr(backward, "layer_backward", lambda *a, ungated=None: kept.append(ungated) or layer_backward(
        *a, ungated=ungated))
    monkeypatch.setattr(backward, "scan_backward", lambda *a, **kw: scans.append(kw["want_y"]) or scan_backward(
        *a, **kw))
    t = {k: v.float() for k, v in layer_inputs(8, 1, 50, init=init, sequences=3 if init else None).items()}
    cu_seqlens = cu(13, 29, 50) if init else None
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    kw = dict(leaves)
    out = tilegym_mamba2.mamba_chunk_scan_combined(kw.pop("x"), kw.pop("dt"), kw.pop("A"), kw.pop("B"), kw.pop("C"),
                                                   16, **kw, cu_seqlens=cu_seqlens, dt_softplus=True)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(dout)
    r = {k: v.double().requires_grad_() for k, v in t.items()}
    ref = layer_token_recurrence(r["x"], r["dt"], r["A"], r["B"], r["C"], r["D"], r["z"], r["dt_bias"],
                                 r.get("initial_states"), None, cu_seqlens, True)[0]
    want_dz, = torch.autograd.grad((ref * dout.double()).sum(), [r["z"]])
    assert rel(leaves["z"].grad, want_dz) < 1e-5
    if init is None:
        ungated = layer_token_recurrence(r["x"], r["dt"], r["A"], r["B"], r["C"], r["D"], None, r["dt_bias"], None,
                                         None, None, True)[0]
        assert kept[0] is not None and rel(kept[0], ungated) < 1e-5
        assert scans == [False]
    else:
        assert kept == [None] and scans == [True]
