"""One packed sequence's values never reach another's outputs, states or gradients, NaN and inf
included: every op with packed sequences or batch slots, a non-finite value planted in one
sequence, the others compared with a clean run. The pytorch backend (on the CPU) selects per
sequence: bit for bit. The cutile backend (on the GPU) quarantines (core/quarantine.py): the
planted sequence comes out NaN, the others as from finite inputs, equal to fp32 rounding
(the kernels' decay sums run across a chunk's sequences)."""
import pytest
import torch

import tilegym_mamba2

CU = [0, 17, 50, 70]          # three sequences, all in the cutile kernels' first 64-token chunk
TOKENS, HEADS, P, N, G = 70, 4, 16, 16, 2
BACKENDS = ["pytorch", pytest.param("cutile", marks=pytest.mark.gpu)]


def _device(backend):
    return "cuda" if backend == "cutile" else "cpu"


def _same(got, want, backend, what):
    """Bit for bit on the pytorch backend; on the cutile backend no non-finite value, and equal to
    fp32 rounding in norm (a sum that cancels across a chunk's sequences can move single small
    elements by more: docs/design.md, "Reliability")."""
    if backend == "pytorch":
        assert torch.equal(got, want), what
        return
    assert torch.isfinite(got).all(), what
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    worst = (got - want).abs().max().item()
    assert err < 1e-5, f"{what}: relative error {err:.2e} in norm, largest difference {worst:.2e}"


def _layer_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(11)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)
    return dict(x=r(1, TOKENS, HEADS, P), dt=r(1, TOKENS, HEADS), A=-torch.rand(HEADS, generator=g, dtype=dtype) - .5,
                B=r(1, TOKENS, G, N), C=r(1, TOKENS, G, N), D=r(HEADS), z=r(1, TOKENS, HEADS, P), dt_bias=r(HEADS))


def _run_layer(inputs, dout, packing, backend):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out, final = tilegym_mamba2.mamba_chunk_scan_combined(**leaves, chunk_size=16, dt_softplus=True,
                                                          return_final_states=True, backend=backend, **packing)
    (out * dout).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _sequence_of(token):
    return max(i for i in range(len(CU) - 1) if CU[i] <= token)


PLANTS = [("dout", 52), ("x", 20), ("B", 60), ("C", 5), ("dt", 49), ("z", 17)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packing", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("where, token", PLANTS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_layer_op_keeps_a_sequences_non_finite_values_to_itself(backend, packing, where, token, value):
    device = _device(backend)
    inputs = {k: v.to(device) for k, v in _layer_inputs().items()}
    dout = torch.randn(1, TOKENS, HEADS, P, generator=torch.Generator().manual_seed(2)).to(device)
    pack = ({"cu_seqlens": torch.tensor(CU, dtype=torch.int32)} if packing == "cu_seqlens" else
            {"seq_idx": torch.tensor([[_sequence_of(t) for t in range(TOKENS)]], dtype=torch.int32)})
    pack = {k: v.to(device) for k, v in pack.items()}
    clean_out, clean_grads = _run_layer(inputs, dout, pack, backend)
    poisoned = dict(inputs)
    if where == "dout":
        dout = dout.clone()
        dout[0, token, 1, 2] = value
    else:
        poisoned[where] = inputs[where].clone()
        poisoned[where][0, token] = value
    out, grads = _run_layer(poisoned, dout, pack, backend)
    hit = _sequence_of(token)
    for s in range(len(CU) - 1):
        part = slice(CU[s], CU[s + 1])
        if s == hit:   # the value is not lost: its sequence's gradients and the shared ones see it
            assert not all(torch.isfinite(grads[n][:, part]).all() for n in ("x", "dt", "B", "C", "z"))
            assert not torch.isfinite(grads["A"]).all()
            continue
        _same(out[:, part], clean_out[:, part], backend, f"out of sequence {s}")
        for name in ("x", "dt", "B", "C", "z"):
            _same(grads[name][:, part], clean_grads[name][:, part], backend, f"d{name} of sequence {s}")


CONV_SEQ = [0] * 10 + [1] * 12 + [-1] * 3 + [2] * 9     # with padding tokens (-1) between sequences


def _conv(x, seq, weight, bias, backend):
    return tilegym_mamba2.causal_conv1d_fn(x, weight, bias, seq_idx=seq, activation="silu", backend=backend)


# The convolution's masks are selects on every backend: bit for bit on both.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("token", [9, 21, 23, 30])   # a sequence's last token, padding, the last sequence
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_causal_conv1d_keeps_a_sequences_and_the_paddings_values_to_themselves(backend, token, value):
    g = torch.Generator().manual_seed(4)
    device = _device(backend)
    x = torch.randn(1, 6, len(CONV_SEQ), generator=g).to(device)
    weight, bias = torch.randn(6, 4, generator=g).to(device), torch.randn(6, generator=g).to(device)
    seq = torch.tensor([CONV_SEQ], dtype=torch.int32, device=device)
    clean = _conv(x, seq, weight, bias, backend)
    poisoned = x.clone()
    poisoned[0, 2, token] = value
    out = _conv(poisoned, seq, weight, bias, backend)
    hit = CONV_SEQ[token]
    others = torch.tensor([s != hit for s in CONV_SEQ], device=device)
    assert torch.equal(out[..., others], clean[..., others])
    assert (out[..., torch.tensor(CONV_SEQ, device=device) == -1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_conv1d_scan_keeps_a_sequences_values_to_itself(backend):
    g = torch.Generator().manual_seed(6)
    device = _device(backend)
    nheads, headdim, dstate, tokens = 2, 16, 16, 40
    dim = nheads * headdim
    zxbcdt = torch.randn(1, tokens, 2 * dim + 2 * dstate + nheads, generator=g).to(device)
    args = tuple(t.to(device) for t in (
        torch.randn(dim + 2 * dstate, 4, generator=g), torch.randn(dim + 2 * dstate, generator=g),
        torch.randn(nheads, generator=g), -torch.rand(nheads, generator=g) - 0.5, torch.randn(nheads, generator=g))) + (16,)
    seq = torch.tensor([[0] * 15 + [1] * 25], dtype=torch.int32, device=device)

    def run(z):
        leaf = z.clone().requires_grad_()
        out = tilegym_mamba2.mamba_split_conv1d_scan_combined(leaf, *args, seq_idx=seq, headdim=headdim,
                                                              backend=backend)
        out.sum().backward()
        return out.detach(), leaf.grad
    clean_out, clean_grad = run(zxbcdt)
    poisoned = zxbcdt.clone()
    poisoned[0, 30] = float("nan")                                  # in sequence 1
    out, grad = run(poisoned)
    assert not torch.isfinite(out[:, 15:]).all() or not torch.isfinite(grad[:, 15:]).all()
    _same(out[:, :15], clean_out[:, :15], backend, "out of sequence 0")
    _same(grad[:, :15], clean_grad[:, :15], backend, "dzxbcdt of sequence 0")


# Decode rows are independent on every backend: bit for bit on both.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["selective_state_update", "causal_conv1d_update"])
def test_decode_steps_keep_a_batch_rows_values_to_its_own_slot(backend, op):
    g = torch.Generator().manual_seed(8)
    device = _device(backend)
    slots, rows = 4, [2, -1, 0]                                     # a padding row in the middle
    indices = torch.tensor(rows, dtype=torch.int32, device=device)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)
    if op == "selective_state_update":
        state = r(slots, 2, 16, 16)
        kw = dict(x=r(3, 2, 16), dt=r(3, 2, 16).abs(), A=-r(2, 16, 16).abs(), B=r(3, 1, 16), C=r(3, 1, 16),
                  state_batch_indices=indices)
        call = lambda s, k: tilegym_mamba2.selective_state_update(s, **k, backend=backend)  # noqa: E731
    else:
        state = r(slots, 6, 3)
        kw = dict(x=r(3, 6), weight=r(6, 4), conv_state_indices=indices)
        call = lambda s, k: tilegym_mamba2.causal_conv1d_update(k["x"], s, k["weight"],  # noqa: E731
                                                                conv_state_indices=k["conv_state_indices"],
                                                                backend=backend)
    clean_state = state.clone()
    clean = call(clean_state, kw)
    poisoned = dict(kw, x=kw["x"].clone())
    poisoned["x"][0] = float("nan")                                  # row 0 (slot 2) only
    poisoned["x"][1] = float("inf")                                  # the padding row
    out_state = state.clone()
    out = call(out_state, poisoned)
    assert torch.equal(out[2], clean[2]) and (out[1] == 0).all()
    for slot in (0, 1, 3):                                           # every slot but row 0's
        assert torch.equal(out_state[slot], clean_state[slot])


# Every option that changes the backward's path for packed sequences: varlen states, initial
# states (one per sequence, or the row's), final states; cu_seqlens or seq_idx.
OPTIONS = [dict(packing="cu_seqlens", varlen=v, init=i, final=f) for v in (False, True)
           for i in (None, "per_sequence") for f in (False, True)] + \
          [dict(packing="seq_idx", varlen=False, init=i, final=f) for i in (None, "row") for f in (False, True)]


def _option_id(o):
    return f"{o['packing']}-varlen{int(o['varlen'])}-init_{o['init']}-final{int(o['final'])}"


def _run_with_options(inputs, init, dout, d_states, pack, o, backend):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    init = None if init is None else init.clone().requires_grad_()
    result = tilegym_mamba2.mamba_chunk_scan_combined(
        **leaves, chunk_size=16, dt_softplus=True, initial_states=init, return_final_states=o["final"],
        return_varlen_states=o["varlen"], backend=backend, **pack)
    result = result if isinstance(result, tuple) else (result,)
    loss = (result[0] * dout).sum()
    if o["final"]:
        loss = loss + (result[1] * d_states[-1:]).sum()
    if o["varlen"]:
        loss = loss + (result[-1] * d_states).sum()
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items()}
    if init is not None:
        grads["initial_states"] = init.grad
    return result[0].detach(), grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("where", ["x", "dt", "B", "C", "z", "initial_states"])
def test_no_option_lets_a_sequences_nan_reach_anothers_gradients(backend, options, where):
    """NaN planted in sequence 1 (or in its initial state; the row's initial state belongs to
    sequence 0): every other sequence's outputs and gradients, its initial state's included,
    are those of the clean run."""
    if where == "initial_states" and options["init"] is None:
        pytest.skip("no initial states in this option set")
    device = _device(backend)
    g = torch.Generator().manual_seed(5)
    inputs = {k: v.to(device) for k, v in _layer_inputs().items()}
    sequences = len(CU) - 1
    init = {None: None, "per_sequence": torch.randn(sequences, HEADS, P, N, generator=g),
            "row": torch.randn(1, HEADS, P, N, generator=g)}[options["init"]]
    init = None if init is None else init.to(device)
    dout = torch.randn(1, TOKENS, HEADS, P, generator=g).to(device)
    d_states = torch.randn(sequences, HEADS, P, N, generator=g).to(device)
    pack = ({"cu_seqlens": torch.tensor(CU, dtype=torch.int32, device=device)} if options["packing"] == "cu_seqlens"
            else {"seq_idx": torch.tensor([[_sequence_of(t) for t in range(TOKENS)]], dtype=torch.int32,
                                          device=device)})
    clean_out, clean_grads = _run_with_options(inputs, init, dout, d_states, pack, options, backend)
    poisoned, poisoned_init, hit = dict(inputs), init, 1
    if where == "initial_states":
        poisoned_init = init.clone()
        hit = 1 if options["init"] == "per_sequence" else 0
        poisoned_init[hit, 0, 0, 0] = float("nan")
    else:
        poisoned[where] = inputs[where].clone()
        poisoned[where][0, 20] = float("nan")    # token 20: sequence 1 = [17, 50)
    out, grads = _run_with_options(poisoned, poisoned_init, dout, d_states, pack, options, backend)
    for s in range(sequences):
        if s == hit:
            continue
        part = slice(CU[s], CU[s + 1])
        _same(out[:, part], clean_out[:, part], backend, f"out of sequence {s}")
        for name in ("x", "dt", "B", "C", "z"):
            _same(grads[name][:, part], clean_grads[name][:, part], backend, f"d{name} of sequence {s}")
        if options["init"] == "per_sequence":
            _same(grads["initial_states"][s], clean_grads["initial_states"][s], backend,
                  f"dinitial_states of sequence {s}")
