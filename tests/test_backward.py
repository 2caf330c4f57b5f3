"""The backward on the CPU: the four-scan decomposition (backward.py) against float64 autograd
of the token recurrence, the "pytorch" backend of mamba2_chunk_backward, autograd and
torch.compile through both ops, argument checks, and ahead-of-time compilation of the
backward's kernels."""

import pytest
import torch


import tilegym_mamba2
from tilegym_mamba2.backends.pytorch import pytorch_kernels
from tilegym_mamba2.ssd.backward import layer_backward
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.ssd.reference.forward import token_recurrence
from tilegym_mamba2.core.validation import scan_combined_call
from tilegym_mamba2.testing import relative_error as rel
from layer_inputs import F64, cu, layer_inputs

INF = float("inf")


DECOMPOSITION_CASES = {
    "one_sequence": dict(batch=2, tokens=37, init="row"),
    "channel_d_clamp": dict(batch=2, tokens=37, init="row", d_per_channel=True, dt_limit=(0.1, 1.5)),
    "no_softplus_no_z": dict(batch=2, tokens=29, z=False, softplus=False),
    "seq_idx": dict(batch=1, tokens=45, init="row", seq_idx=[[0] * 10 + [1] * 20 + [2] * 15]),
    "seq_idx_rows": dict(batch=2, tokens=30, init="row", seq_idx=[[0] * 10 + [1] * 20, [1] * 5 + [2] * 25]),
    "per_sequence_init_varlen": dict(batch=1, tokens=45, init="sequence", cu_seqlens=cu(10, 11, 30, 45), varlen=True),
    "row_init_varlen": dict(batch=1, tokens=45, init="row", cu_seqlens=cu(10, 11, 30, 45), varlen=True),
    "cu_seqlens_no_init": dict(batch=1, tokens=45, z=False, cu_seqlens=cu(1, 20, 45)),
}


def check_layer_backward(name, kernels, chunk_size, seed):
    """layer_backward on DECOMPOSITION_CASES[name] against float64 autograd through the token
    recurrence: every gradient to 1e-11 (a wrong term would be off by O(1))."""
    case = dict(DECOMPOSITION_CASES[name])
    softplus, limit = case.pop("softplus", True), case.pop("dt_limit", (0.0, INF))
    seq_idx = None if "seq_idx" not in case else torch.tensor(case.pop("seq_idx"))
    cu_seqlens, varlen = case.pop("cu_seqlens", None), case.pop("varlen", False)
    t = layer_inputs(seed, sequences=None if cu_seqlens is None else cu_seqlens.numel() - 1, **case)
    if not softplus:
        t["dt"] = t["dt"].abs() + 0.1
    names = list(t)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    out, final, states = layer_token_recurrence(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], leaves["D"], leaves.get("z"),
        leaves.get("dt_bias"), leaves.get("initial_states"), seq_idx, cu_seqlens, softplus, limit)
    g = torch.Generator().manual_seed(5)
    dout, dfinal = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(final.shape, generator=g, dtype=F64)
    dstates = torch.randn(states.shape, generator=g, dtype=F64) if varlen else None
    loss = (out * dout).sum() + (final * dfinal).sum() + ((states * dstates).sum() if varlen else 0)
    refs = torch.autograd.grad(loss, [leaves[k] for k in names])

    saved = scan_combined_call(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size, t["D"], t.get("z"),
                             t.get("dt_bias"), t.get("initial_states"), seq_idx, cu_seqlens, softplus, limit, True,
                             varlen)
    grads = dict(zip(["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"],
                     layer_backward(kernels, saved, dout, dfinal, dstates)))
    for k, ref in zip(names, refs):
        assert grads[k] is not None and grads[k].shape == ref.shape, k
        assert rel(grads[k], ref) < 1e-11, (k, rel(grads[k], ref))
    if "initial_states" not in t:
        assert grads["initial_states"] is None


@pytest.mark.parametrize("chunk", [8, 16])
@pytest.mark.parametrize("name", list(DECOMPOSITION_CASES))
def test_decomposition_matches_float64_autograd(name, chunk):
    """backward.py on the pytorch backend's kernels in float64 (chunk states, reversed scans padded
    to whole chunks, chunk_grads_reference, per-sequence edge terms; the path the cutile backend
    takes on its kernels): every gradient equals float64 autograd through the token recurrence."""
    check_layer_backward(name, pytorch_kernels(F64, chunk_size=chunk), chunk, 1234 + chunk)


@pytest.mark.parametrize("seq", [None, [[0] * 10 + [1] * 20 + [2] * 15], [[0] * 8 + [1] * 1 + [2] * 20 + [3] * 16]])
@pytest.mark.parametrize("tokens", [45, 40])
def test_chunk_grads_reference_is_the_token_by_token_gradient(seq, tokens):
    """The chunk-local gradients (what ssd/chunk_grads.py computes) equal those from
    token-by-token states h_t and state gradients dh_t, sequences included: dxs_t = dh_t b_t,
    dc_t = h_t^T dy_t, db_t = w_t dh_t^T x_t (summed over a group's heads), ddt_input = x . dxs
    and dl_u = <dh_u, exp(l_u) h_{u-1}>."""
    from tilegym_mamba2.ssd.reference.chunk_grads import chunk_grads_reference
    g = torch.Generator().manual_seed(tokens)
    batch, groups, heads, state, head, L = 1, 2, 4, 5, 3, 8
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)
    x, dy = randn(batch, tokens, heads, head), randn(batch, tokens, heads, head)
    b, c = randn(batch, tokens, groups, state), randn(batch, tokens, groups, state)
    w = torch.rand(batch, tokens, heads, generator=g, dtype=F64) + 0.1
    l = -torch.rand(batch, tokens, heads, generator=g, dtype=F64)
    h0, dfinal = randn(batch, heads, head, state), randn(batch, heads, head, state)
    seq_idx = torch.zeros(batch, tokens, dtype=torch.long) if seq is None else torch.tensor(seq)[:, :tokens]
    br, cr = b.repeat_interleave(2, 2)[0], c.repeat_interleave(2, 2)[0]
    new_seq = torch.ones(tokens, dtype=torch.bool)
    new_seq[1:] = seq_idx[0, 1:] != seq_idx[0, :-1]
    before, after = [], []  # h_{t-1} (of t's sequence) and h_t
    h = h0[0] * (seq_idx[0, 0] == 0)
    for t in range(tokens):
        if t and new_seq[t]:
            h = torch.zeros_like(h)
        before.append(h)
        h = torch.exp(l[0, t])[:, None, None] * h + w[0, t][:, None, None] * x[0, t][..., None] * br[t][:, None]
        after.append(h)
    grads = [None] * tokens
    for t in reversed(range(tokens)):
        own = dy[0, t][..., None] * cr[t][:, None]
        if t == tokens - 1:
            grads[t] = dfinal[0] + own
        else:
            grads[t] = own + (0 if new_seq[t + 1] else torch.exp(l[0, t + 1])[:, None, None] * grads[t + 1])
    expected = torch.stack([(grads[t] * torch.exp(l[0, t])[:, None, None] * before[t]).sum((-1, -2))
                            for t in range(tokens)])
    chunks = -(-tokens // L)
    entry = torch.stack([h0[0] * (seq_idx[0, 0] == 0) if k == 0 else after[k * L - 1] for k in range(chunks)])
    end = torch.stack([dfinal[0] if (k + 1) * L >= tokens else torch.exp(l[0, (k + 1) * L])[:, None, None]
                       * grads[(k + 1) * L] for k in range(chunks)])
    got = chunk_grads_reference(x, b, c, dy, w, l, entry[None], end[None], None if seq is None else seq_idx,
                                chunk_size=L)
    dxs = torch.stack([torch.einsum("hpn,hn->hp", grads[t], br[t]) for t in range(tokens)])
    dc = torch.stack([torch.einsum("hpn,hp->hn", after[t], dy[0, t]) for t in range(tokens)])
    db = torch.stack([w[0, t][:, None] * torch.einsum("hpn,hp->hn", grads[t], x[0, t]) for t in range(tokens)])

    def group_sums(t):
        return t.reshape(tokens, groups, heads // groups, state).sum(2)

    for name, value, want in zip(("dxs", "ddt_input", "dl", "db", "dc"), got,
                                 (dxs, (x[0] * dxs).sum(-1), expected, group_sums(db), group_sums(dc))):
        assert torch.allclose(value[0], want, rtol=1e-12, atol=1e-12), name


def plain_inputs(seed=0, batch=2, tokens=50, groups=2, heads=4, state=16, head=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, heads, head, generator=g)
    b, c = torch.randn(batch, tokens, groups, state, generator=g), torch.randn(batch, tokens, groups, state, generator=g)
    a, d = -torch.rand(heads, generator=g) - 0.5, torch.randn(heads, generator=g)
    dt = torch.rand(batch, tokens, heads, generator=g) + 0.1
    init = torch.randn(batch, heads, head, state, generator=g)
    return [t.to(dtype) if t.dim() > 1 and t is not init and t is not dt else t for t in (x, a, b, c, d, dt, init)]


def test_chunk_backward_pytorch_backend_matches_float64():
    x, a, b, c, d, dt, init = plain_inputs()
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(x.shape, generator=g)
    dfinal = torch.randn(init.shape, generator=g)
    grads = tilegym_mamba2.mamba2_chunk_backward(x, a, b, c, d, dt, init, dout, dfinal, 16, backend="pytorch")
    leaves = [t.double().requires_grad_() for t in (x, a, b, c, d, dt, init)]
    out, final = token_recurrence(*leaves)
    refs = torch.autograd.grad((out * dout.double()).sum() + (final * dfinal.double()).sum(), leaves)
    for name, got, ref in zip(["dx", "da", "db", "dc", "dd", "ddt", "dinit_state"], grads, refs):
        assert got.shape == ref.shape, name
        assert rel(got, ref) < 1e-4, (name, rel(got, ref))
    assert [g.dtype for g in grads] == [torch.float32] * 7


def test_chunk_backward_without_init_or_final_gradient():
    x, a, b, c, d, dt, _ = plain_inputs(tokens=33)
    dout = torch.randn(x.shape)
    grads = tilegym_mamba2.mamba2_chunk_backward(x, a, b, c, d, dt, None, dout, None, 16, backend="pytorch")
    assert torch.equal(grads[6], torch.zeros(2, 4, 8, 16))
    leaves = [t.double().requires_grad_() for t in (x, a, b, c, d, dt)]
    refs = torch.autograd.grad((token_recurrence(*leaves)[0] * dout.double()).sum(), leaves)
    for got, ref in zip(grads, refs):
        assert rel(got, ref) < 1e-4


def test_forward_is_differentiable_through_tilegym_ops():
    """tilegym.ops.mamba2_chunk_forward (our pytorch backend) gives the explicit backward's gradients."""
    import tilegym
    x, a, b, c, d, dt, init = plain_inputs(tokens=40)
    leaves = [t.clone().requires_grad_() for t in (x, a, b, c, d, dt, init)]
    out, final = tilegym.ops.mamba2_chunk_forward(*leaves, chunk_size=16, backend="pytorch")
    dout, dfinal = torch.randn(out.shape), torch.randn(final.shape)
    torch.autograd.backward([out, final], [dout, dfinal])
    expected = tilegym_mamba2.mamba2_chunk_backward(x, a, b, c, d, dt, init, dout, dfinal, 16, backend="pytorch")
    for leaf, want in zip(leaves, expected):
        assert torch.allclose(leaf.grad, want, rtol=1e-5, atol=1e-6)


def test_compile_fullgraph_forward_and_backward():
    """A model calling both ops compiles without graph breaks, and its gradients are eager's."""
    x, a, b, c, d, dt, init = plain_inputs(tokens=32, groups=1)

    def model(x, a, b, c, d, dt, init):
        y, final = tilegym_mamba2.mamba2_chunk_forward(x, a, b, c, d, dt, init, chunk_size=16, backend="pytorch")
        y2 = tilegym_mamba2.mamba_chunk_scan_combined(y, dt, a, b, c, 16, D=d, z=x, dt_bias=d, dt_softplus=True,
                                                       backend="pytorch")
        return (y2 * y).sum() + final.square().sum()

    grads = []
    for fn in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (x, a, b, c, d, dt, init)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        assert torch.allclose(eager, compiled, rtol=1e-5, atol=1e-5)


def test_no_grad_calls_skip_the_custom_op(monkeypatch):
    """Inference keeps its direct path: the autograd op is not entered without a gradient."""
    import tilegym_mamba2.backends.base as base
    calls = []
    monkeypatch.setattr(base, "differentiable_chunk_forward", lambda *a: calls.append(a))
    x, a, b, c, d, dt, init = plain_inputs(tokens=20)
    tilegym_mamba2.mamba2_chunk_forward(x, a, b, c, d, dt, init, 16, backend="pytorch")
    with torch.no_grad():
        tilegym_mamba2.mamba2_chunk_forward(x.requires_grad_(), a, b, c, d, dt, init, 16, backend="pytorch")
    assert calls == []


@pytest.mark.parametrize("change,message", [
    (dict(dout=torch.zeros(2, 50, 4, 7)), "dout"),
    (dict(dout=torch.zeros(2, 50, 4, 8, dtype=torch.int32)), "dout"),
    (dict(dfinal_state=torch.zeros(2, 4, 8, 15)), "dfinal_state"),
    (dict(dfinal_state=[0.0]), "dfinal_state"),
])
def test_backward_bad_arguments_name_them(change, message):
    x, a, b, c, d, dt, init = plain_inputs()
    args = dict(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=init, dout=torch.zeros(x.shape),
                dfinal_state=torch.zeros(init.shape))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=message):
        tilegym_mamba2.mamba2_chunk_backward(**args, backend="pytorch")


def test_backward_registered_with_tilegym():
    import tilegym
    from tilegym.backend import dispatcher
    slots = dispatcher._REGISTRY["mamba2_chunk_backward"]
    assert getattr(slots["cutile"], "target", "") == "tilegym_mamba2.backends.cutile:mamba2_chunk_backward"
    x, a, b, c, d, dt, init = plain_inputs(tokens=20)
    grads = tilegym.ops.mamba2_chunk_backward(x, a, b, c, d, dt, init, torch.ones(x.shape), torch.ones(init.shape),
                                              16, backend="pytorch")
    assert len(grads) == 7 and grads[2].shape == b.shape


def test_backward_kernels_compile_ahead_of_time():
    pytest.importorskip("cuda.tile")
    from tilegym_mamba2.core.toolchain import find_toolchain
    if find_toolchain().tileiras is None:
        pytest.skip("tileiras not found (pip install \"cuda-tile[tileiras]\")")
    from tilegym_mamba2.aot import compile_backward_kernels
    for layer in (None, "packed", "sequence_states"):
        results = compile_backward_kernels("sm_90", tokens=200, heads=4, head_size=32, state_size=64, layer=layer)
        names = {name for name, _, _ in results}
        # The plain op needs only chunk states, both scans' from the walk; the layer op's z needs
        # the forward's outputs (the forward's stages); its scan of dh is the walk on packed
        # sequences, the forward's stages on the flipped inputs where sequences have their own
        # states (and its outputs, the varlen states, hold their gradients); z's gradients and
        # the dy it passes on are the gate kernels'.
        grads = {"given_decay_cumsum_kernel", "chunk_grads_columns_kernel", "chunk_grads_rows_kernel"}
        expected = {"chunk_states_walk_kernel"} | grads
        if layer is not None:
            expected |= {"segment_states_kernel", "state_scan_kernel", "compute_out_kernel", "varlen_states_kernel",
                         "gate_dy_kernel", "gate_dz_kernel"}
        if layer == "sequence_states":
            expected = expected - {"chunk_states_walk_kernel"} | {"sequence_init_kernel"}
        assert names == expected, (layer, names)
        assert all(size > 0 for _, size, _ in results)


def test_sequence_edge_terms_complete_the_decay_gradient():
    """With per-sequence starting states I_s and end-state gradients dE_s (chunk states hold
    neither), sequence_edge_terms is exactly what they add to <dh_u, exp(l_u) h_{u-1}>."""
    from tilegym_mamba2.ssd.backward import sequence_edge_terms
    g = torch.Generator().manual_seed(0)
    tokens, groups, heads, state, head = 45, 2, 4, 5, 3
    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)
    x, dy = randn(1, tokens, heads, head), randn(1, tokens, heads, head)
    b, c = randn(1, tokens, groups, state), randn(1, tokens, groups, state)
    w = torch.rand(1, tokens, heads, generator=g, dtype=F64) + 0.1
    l = -torch.rand(1, tokens, heads, generator=g, dtype=F64)
    cu_seqlens = torch.tensor([0, 7, 8, 30, 45])
    seq = torch.searchsorted(cu_seqlens[1:], torch.arange(tokens), right=True)
    starts, ends = randn(4, heads, head, state), randn(4, heads, head, state)
    br, cr = b.repeat_interleave(2, 2)[0], c.repeat_interleave(2, 2)[0]
    first = torch.ones(tokens, dtype=torch.bool)
    first[1:] = seq[1:] != seq[:-1]
    last = torch.ones(tokens, dtype=torch.bool)
    last[:-1] = seq[1:] != seq[:-1]

    def state_products(starts, ends):
        before, h = [], None
        for t in range(tokens):
            h = starts[seq[t]] if first[t] else h
            before.append(h)
            h = torch.exp(l[0, t])[:, None, None] * h + w[0, t][:, None, None] * x[0, t][..., None] * br[t][:, None]
        grads = [None] * tokens
        for t in reversed(range(tokens)):
            own = dy[0, t][..., None] * cr[t][:, None]
            grads[t] = ends[seq[t]] + own if last[t] else own + torch.exp(l[0, t + 1])[:, None, None] * grads[t + 1]
        return torch.stack([(grads[t] * torch.exp(l[0, t])[:, None, None] * before[t]).sum((-1, -2))
                            for t in range(tokens)])

    with_edges = state_products(starts, ends)
    without = state_products(torch.zeros_like(starts), torch.zeros_like(ends))
    added = sequence_edge_terms(x, b, c, dy, w, l, cu_seqlens, seq[None], starts, ends)[0]
    assert torch.allclose(without + added, with_edges, rtol=1e-12, atol=1e-12)
    assert (with_edges - without).abs().max() > 0.1  # the edges matter in this case


def test_state_512_runs_as_two_halves(monkeypatch):
    """The cutile backend's state_size 512 (two runs of 256, by linearity), with each half run on
    the pytorch backend: the same result as one run over the whole state, forward and backward."""
    import tilegym_mamba2.backends.cutile as cutile
    cutile_backward = cutile
    from tilegym_mamba2.backends.pytorch import kernels_for, mamba2_chunk_forward_pytorch
    from tilegym_mamba2.core.validation import BackwardArgs, ForwardArgs, check_forward_args
    from tilegym_mamba2.runtime.limits import PYTORCH as PYTORCH_LIMITS
    from tilegym_mamba2.backends.pytorch import chunk_forward_reference
    monkeypatch.setattr(cutile, "chunk_forward_kernels", chunk_forward_reference)
    monkeypatch.setattr(cutile, "check_forward_args", lambda limits, **call: check_forward_args(**call,
                                                                                                 limits=PYTORCH_LIMITS))
    x, a, b, c, d, dt, init = plain_inputs(tokens=70, groups=2, state=512)
    out, final = cutile.split_state_forward(ForwardArgs(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=init, chunk_size=64))
    want_out, want_final = mamba2_chunk_forward_pytorch(x, a, b, c, d, dt, init, 64)
    assert torch.allclose(out, want_out, rtol=1e-5, atol=1e-4)
    assert torch.allclose(final, want_final, rtol=1e-5, atol=1e-4)

    monkeypatch.setattr(cutile_backward, "KERNELS", kernels_for(torch.float32))
    dout, dfinal = torch.randn(x.shape), torch.randn(init.shape)
    args = (x, a, b, c, d, dt, init, dout, dfinal)
    got = cutile_backward._split_state_backward(BackwardArgs(x=x, a=a, b=b, c=c, d=d, dt=dt, init_state=init, dout=dout,
                                                             dfinal_state=dfinal, chunk_size=64))
    want = tilegym_mamba2.mamba2_chunk_backward(*args, 64, backend="pytorch")
    for name, g, w in zip(["dx", "da", "db", "dc", "dd", "ddt", "dinit_state"], got, want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-3, atol=1e-3), name


def _chunk_entry_states(x, b, weight, log_decay, init, seq_idx, cu_seqlens, L):
    """[batch, chunks, heads, head_size, state_size]: the state entering each chunk (of the
    sequence of the token before it), as the cutile state pass leaves them: a row's initial state
    enters its sequence 0, per-sequence initial states do not enter at all."""
    batch, tokens, heads, _ = x.shape
    per_head_b = b.repeat_interleave(heads // b.shape[2], 2)
    row_init = None if init is None or (cu_seqlens is not None and init.shape[0] != batch) else init
    seq = torch.zeros(batch, tokens, dtype=torch.long) if seq_idx is None else seq_idx.long()
    entries = []
    for row in range(batch):
        h = torch.zeros(heads, x.shape[3], b.shape[3], dtype=F64)
        if row_init is not None and seq[row, 0] == 0:
            h = row_init[row].to(F64)
        row_entries = []
        for t in range(-(-tokens // L) * L):
            if t % L == 0:
                row_entries.append(h)
            if t >= tokens:
                continue
            if t and seq[row, t] != seq[row, t - 1]:
                h = torch.zeros_like(h)
            h = (torch.exp(log_decay[row, t].to(F64))[:, None, None] * h
                 + weight[row, t].to(F64)[:, None, None] * x[row, t].to(F64)[..., None] * per_head_b[row, t][:, None])
        entries.append(torch.stack(row_entries))
    return torch.stack(entries)


@pytest.mark.parametrize("seq", [None, [[0] * 10 + [1] * 20 + [2] * 15, [1] * 5 + [2] * 40],
                                 [[0] * 8 + [1] * 1 + [2] * 20 + [3] * 16, [0] * 45]])
def test_chunk_entry_states_are_the_token_states(seq):
    """scan_reference.chunk_entry_states (the pytorch backend's chunk states, chunk by chunk)
    equals the token-by-token state before each chunk, sequences inside chunks included."""
    from tilegym_mamba2.ssd.reference.chunk_states_walk import chunk_entry_states
    g = torch.Generator().manual_seed(3)
    batch, tokens = 2, 45
    x, b = torch.randn(batch, tokens, 4, 3, generator=g, dtype=F64), torch.randn(batch, tokens, 2, 5, generator=g,
                                                                                 dtype=F64)
    w = torch.rand(batch, tokens, 4, generator=g, dtype=F64)
    l = -torch.rand(batch, tokens, 4, generator=g, dtype=F64)
    init = torch.randn(batch, 4, 3, 5, generator=g, dtype=F64)
    seq_idx = None if seq is None else torch.tensor(seq)
    got = chunk_entry_states(x, b, w, l, init, seq_idx, 8, F64)
    assert torch.allclose(got, _chunk_entry_states(x, b, w, l, init, seq_idx, None, 8), rtol=1e-12, atol=1e-12)


def test_gated_dy_keeps_what_its_rounding_left_out():
    """With z, dy = dout * z * sigmoid(z) * ... is not a bf16 number: chunk_grads gets it as two
    bf16 terms, so that its rounding does not reach dA. On the pytorch backend, in fp32, dA's
    error against float64 with the second term and without it (it was 2-10x larger without)."""
    from tilegym_mamba2.ssd.backward import Kernels
    from tilegym_mamba2.ssd.dt import process_dt
    from tilegym_mamba2.ssd.reference.layer import chunked_layer_reference

    kernels = pytorch_kernels(torch.float32)
    high_only = Kernels(kernels.scan, lambda *args: kernels.chunk_grads(*args[:9]), kernels.chunk_size)
    errors = {"split": [], "high only": []}
    for seed in (1, 2, 3):
        g = torch.Generator().manual_seed(seed)
        def randn(*shape):
            return torch.randn(*shape, generator=g)
        bf = torch.bfloat16
        x = torch.nn.functional.silu(randn(1, 512, 4, 32)).to(bf)
        B, C = (torch.nn.functional.silu(randn(1, 512, 1, 32)).to(bf) for _ in range(2))
        A, dt, dt_bias = -(1 + 15 * torch.rand(4, generator=g)), (randn(1, 512, 4) - 2).to(bf), randn(4) - 1
        z, D, dout = randn(1, 512, 4, 32).to(bf), randn(4), randn(1, 512, 4, 32).to(bf)
        leaf = A.double().requires_grad_()
        out = chunked_layer_reference(x.double(), process_dt(dt.double(), dt_bias.double(), True, dtype=F64), leaf,
                                      B.double(), C.double(), D.double(), z.double(), None, None, None,
                                      chunk_size=64)[0]
        want = torch.autograd.grad((out * dout.double()).sum(), leaf)[0]
        saved = scan_combined_call(x, dt, A, B, C, 64, D, z, dt_bias, None, None, None, True, (0.0, INF), False, False)
        for name, ks in (("split", kernels), ("high only", high_only)):
            errors[name].append(rel(layer_backward(ks, saved, dout)[2], want))
    assert max(errors["split"]) < 1e-3, errors
    assert sum(errors["split"]) < 0.5 * sum(errors["high only"]), errors
