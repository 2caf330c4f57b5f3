"""mamba_split_conv1d_scan_combined (split_conv1d_scan.py) against a float64 definition written
out here (a tap-by-tap causal convolution, the token recurrence, the gated group RMSNorm, the
projections): outputs and every gradient, on the pytorch backend (CPU, float64)."""
import pytest
import torch
import torch.nn.functional as F

import tilegym
import tilegym_mamba2
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence

F64 = torch.float64

CASES = {
    # HF's Mamba2Mixer in training: norm after the gate, projection without bias, D per head.
    "hf_mixer": dict(),
    "groups_norm_first": dict(ngroups=2, norm_before_gate=True, D="channel", outproj_bias=True,
                              dt_limit=(0.02, 0.4)),
    "no_norm_z_gate": dict(rmsnorm=False, outproj=False, activation=None, initial_states=True,
                           return_final_states=True),
    "mlp_channels": dict(d_nonssm=3, outproj_bias=True),
    "packed": dict(seq_idx=True, initial_states=True, return_final_states=True),
}


def make_case(name, seed=0, batch=2, seqlen=45, nheads=4, headdim=8, dstate=16, width=4, out_dim=12):
    o = CASES[name]
    ngroups, d_nonssm = o.get("ngroups", 1), o.get("d_nonssm", 0)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=F64)).requires_grad_()

    dim = nheads * headdim
    conv_dim = dim + 2 * ngroups * dstate
    args = dict(
        zxbcdt=randn(batch, seqlen, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads),
        conv1d_weight=randn(conv_dim, width, scale=0.5), conv1d_bias=randn(conv_dim, scale=0.1),
        dt_bias=(torch.rand(nheads, generator=g, dtype=F64) - 3).requires_grad_(),
        A=(-torch.rand(nheads, generator=g, dtype=F64) - 0.5).requires_grad_(),
        D=randn(nheads, *((headdim,) if o.get("D") == "channel" else ())),
        chunk_size=16)
    kw = dict(headdim=headdim, ngroups=ngroups, norm_before_gate=o.get("norm_before_gate", False),
              activation=o.get("activation", "silu"), dt_limit=o.get("dt_limit", (0.0, float("inf"))),
              return_final_states=o.get("return_final_states", False), rmsnorm_eps=1e-5)
    if o.get("rmsnorm", True):
        kw["rmsnorm_weight"] = (1 + randn(dim, scale=0.1)).detach().requires_grad_()
    if o.get("outproj", True):
        kw["outproj_weight"] = randn(out_dim, dim + d_nonssm, scale=0.2)
        if o.get("outproj_bias"):
            kw["outproj_bias"] = randn(out_dim, scale=0.1)
    if o.get("initial_states"):
        kw["initial_states"] = randn(batch, nheads, headdim, dstate, scale=0.3)
    if o.get("seq_idx"):
        seq = torch.zeros(batch, seqlen, dtype=torch.int32)
        seq[:, 10:] += 1
        seq[1, 30:] += 1
        kw["seq_idx"] = seq
    return args, kw


def definition(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
               dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
               rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1,
               norm_before_gate=True):
    batch, seqlen, _ = zxbcdt.shape
    nheads = D.shape[0]
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // (2 * ngroups)
    d_nonssm = (zxbcdt.shape[2] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    width = conv1d_weight.shape[1]
    seq = torch.zeros(batch, seqlen, dtype=torch.long, device=zxbcdt.device) if seq_idx is None else seq_idx.long()
    conv = conv1d_bias.expand(batch, seqlen, -1)
    for tap in range(width):  # the input tap positions back, from the same sequence only
        back = width - 1 - tap
        shifted = F.pad(xBC, (0, 0, back, 0))[:, :seqlen]
        same = torch.ones(batch, seqlen, dtype=torch.bool, device=zxbcdt.device)
        if back:
            same[:, back:] = seq[:, back:] == seq[:, :-back]
            same[:, :back] = False
        conv = conv + conv1d_weight[:, tap] * shifted * same[..., None]
    xBC = F.silu(conv) if activation in ("silu", "swish") else conv
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(batch, seqlen, nheads, headdim)
    B, C = B.reshape(batch, seqlen, ngroups, dstate), C.reshape(batch, seqlen, ngroups, dstate)
    zh = z.reshape(batch, seqlen, nheads, headdim)
    y, final, _ = layer_token_recurrence(x, dt, A, B, C, D, None if rmsnorm_weight is not None else zh, dt_bias,
                                         initial_states, seq_idx, None, True, dt_limit)
    y = y.reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        gate = F.silu(z)
        v = y if norm_before_gate else y * gate
        groups = v.reshape(batch, seqlen, ngroups, dim // ngroups)
        v = (groups / torch.sqrt(groups.square().mean(-1, keepdim=True) + rmsnorm_eps)).reshape(v.shape)
        y = v * rmsnorm_weight * (gate if norm_before_gate else 1)
    if d_nonssm:
        y = torch.cat([F.silu(zx0[..., :d_nonssm]) * zx0[..., d_nonssm:], y], dim=-1)
    if outproj_weight is not None:
        y = y @ outproj_weight.T + (0 if outproj_bias is None else outproj_bias)
    return (y, final) if return_final_states else y


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_definition_outputs_and_gradients(name):
    args, kw = make_case(name)
    leaves = [t for t in (*args.values(), *kw.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    got = tilegym_mamba2.mamba_split_conv1d_scan_combined(*args.values(), **kw)
    want = definition(*args.values(), **kw)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-10), (g - w).abs().max()
    cotangents = [torch.randn(w.shape, generator=torch.Generator().manual_seed(7), dtype=F64) for w in want]
    grads = torch.autograd.grad(sum((g * c).sum() for g, c in zip(got, cotangents)), leaves)
    refs = torch.autograd.grad(sum((w * c).sum() for w, c in zip(want, cotangents)), leaves)
    for leaf_grad, ref in zip(grads, refs):
        assert torch.allclose(leaf_grad, ref, rtol=1e-8, atol=1e-9), (leaf_grad - ref).abs().max()


@pytest.mark.parametrize("name", ["hf_mixer", "packed"])
def test_compiles_fullgraph(name):
    """torch.compile(fullgraph=True) traces the call (the scan's custom op gets x as a strided
    view of the convolution's output: its fake must give the real op's strides) and matches eager,
    forward and backward."""
    args, kw = make_case(name)
    tensors = {k: v.detach().float().requires_grad_(v.requires_grad) if v.is_floating_point() else v
               for k, v in {**args, **kw}.items() if isinstance(v, torch.Tensor)}
    names = [k for k, v in tensors.items() if v.requires_grad]

    def loss(*leaves):
        out = tilegym_mamba2.mamba_split_conv1d_scan_combined(**{**args, **kw, **tensors, **dict(zip(names, leaves))})
        return (out[0] if isinstance(out, tuple) else out).square().sum()

    leaves = [tensors[k] for k in names]
    eager = loss(*leaves)
    compiled = torch.compile(loss, fullgraph=True)(*leaves)
    assert torch.allclose(compiled, eager, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(compiled, leaves), torch.autograd.grad(eager, leaves)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_under_tilegym_ops():
    args, kw = make_case("hf_mixer")
    expected = tilegym_mamba2.mamba_split_conv1d_scan_combined(*args.values(), **kw)
    got = tilegym.ops.mamba2_split_conv1d_scan_combined(*args.values(), **kw, backend="pytorch")
    assert torch.equal(got, expected)


@pytest.mark.parametrize("change,message", [
    (dict(zxbcdt=torch.zeros(2, 45)), "zxbcdt must be"),
    (dict(zxbcdt=torch.zeros(2, 45, 10)), "zxbcdt's last dimension"),
    (dict(conv1d_weight=torch.zeros(33, 4)), "conv1d_weight must be"),
    (dict(conv1d_bias=torch.zeros(5)), "conv1d_bias must be"),
    (dict(A=torch.zeros(3)), "A must be"),
    (dict(D=torch.zeros(4, 8, 2)), "D must be"),
    (dict(headdim=None), "headdim must be"),
    (dict(ngroups=3), "ngroups must be"),
    (dict(activation="relu"), "activation must be"),
    (dict(rmsnorm_weight=torch.zeros(5)), "rmsnorm_weight must be"),
    (dict(outproj_weight=torch.zeros(12, 7)), "outproj_weight must be"),
    (dict(dt_bias=[0.0] * 4), "dt_bias must be a torch.Tensor"),
    (dict(outproj_weight=torch.zeros(5, 32), outproj_bias=torch.zeros(6)), r"outproj_bias must be \[out_dim\] = \(5,\)"),
    (dict(rmsnorm_weight=[1.0] * 32), "rmsnorm_weight must be a torch.Tensor or None"),
    (dict(conv1d_bias=[0.0] * 64), "conv1d_bias must be a torch.Tensor or None"),
    (dict(outproj_weight=[[0.0] * 32] * 12), "outproj_weight must be a torch.Tensor or None"),
    (dict(rmsnorm_eps=-1.0), "rmsnorm_eps must be a positive finite number"),
    (dict(rmsnorm_eps=float("nan")), "rmsnorm_eps must be a positive finite number"),
    (dict(rmsnorm_eps="1e-5"), "rmsnorm_eps must be a positive number, got str"),
    (dict(conv1d_weight=torch.zeros(64, 5)), r"conv1d_weight must be .* width one of \(2, 3, 4\)"),
    (dict(norm_before_gate="no"), "norm_before_gate must be True or False"),
    (dict(ngroups=True), "ngroups must be an int"),
    (dict(D=torch.zeros(5)), r"D must be \[nheads\] or \[nheads, headdim\] with nheads = 4"),
    (dict(conv1d_weight=torch.zeros(64, 4, dtype=torch.int64)), "conv1d_weight must be a floating-point tensor"),
    (dict(outproj_bias=torch.zeros(12, dtype=torch.int64)), "outproj_bias must be a floating-point tensor"),
])
def test_bad_input_names_the_argument(change, message):
    args, kw = make_case("hf_mixer")
    for key, value in change.items():
        (args if key in args else kw)[key] = value
    with pytest.raises((ValueError, TypeError), match=message):
        tilegym_mamba2.mamba_split_conv1d_scan_combined(*args.values(), **kw)


def test_a_five_wide_convolution_is_refused_alike_with_and_without_seq_idx():
    args, kw = make_case("hf_mixer")
    args["conv1d_weight"] = torch.zeros(64, 5)
    for seq_idx in (None, torch.zeros(2, 45, dtype=torch.int32)):
        with pytest.raises(ValueError, match="conv1d_weight must be"):
            tilegym_mamba2.mamba_split_conv1d_scan_combined(*args.values(), **kw, seq_idx=seq_idx)


def test_integer_zxbcdt_is_named():
    args, kw = make_case("hf_mixer")
    args["zxbcdt"] = args["zxbcdt"].to(torch.int64)
    with pytest.raises(TypeError, match="zxbcdt must be a floating-point"):
        tilegym_mamba2.mamba_split_conv1d_scan_combined(*args.values(), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hf_mixer", "packed"])
def test_cutile_backend_matches_float64_on_the_gpu(name):
    """The same composition with the scan on our cuTile kernels, bf16 inputs (fp32 norm and
    projection weights, as a mixed-precision model has them): outputs and gradients within bf16
    error of the float64 definition."""
    from gpu_checks import fresh_seed, rel_err

    seed = fresh_seed()
    args, kw = make_case(name, seed=seed % 1000, batch=2, seqlen=300, nheads=8, headdim=64, dstate=64,
                         out_dim=96)
    args["chunk_size"] = 256

    def on_gpu(t, dtype):
        return t.detach().to("cuda", dtype).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    ours = {k: on_gpu(v, torch.bfloat16 if k == "zxbcdt" else torch.float32) for k, v in {**args, **kw}.items()}
    if "seq_idx" in ours:
        ours["seq_idx"] = ours["seq_idx"].to(torch.int32)
    ref = {k: on_gpu(v, F64) if k != "seq_idx" else v.long() for k, v in ours.items()}  # the rounded inputs
    got = tilegym_mamba2.mamba_split_conv1d_scan_combined(**ours, backend="cutile")
    want = definition(**ref)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 2e-2, f"{name} seed={seed}: output {rel_err(g, w):.2e}"
    leaves = [k for k, v in ours.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    cotangents = [torch.randn(w.shape, device="cuda", dtype=F64) for w in want]
    grads = torch.autograd.grad(sum((g.double() * c).sum() for g, c in zip(got, cotangents)), [ours[k] for k in leaves])
    refs = torch.autograd.grad(sum((w * c).sum() for w, c in zip(want, cotangents)), [ref[k] for k in leaves])
    for key, g, r in zip(leaves, grads, refs):
        assert rel_err(g, r) < 3e-2, f"{name} seed={seed}: d{key} {rel_err(g, r):.2e}"


def test_a_device_mismatch_and_a_disagreeing_headdim_name_the_callers_arguments():
    heads, head_size, state = 4, 8, 16
    dim = heads * head_size
    zxbcdt = torch.empty(1, 10, 2 * dim + 2 * state + heads, device="meta")
    weight = torch.randn(dim + 2 * state, 4)
    with pytest.raises(ValueError, match=r"all tensors must be on zxbcdt's device \(meta\), got conv1d_weight on cpu"):
        tilegym_mamba2.mamba_split_conv1d_scan_combined(zxbcdt, weight, None, torch.randn(heads), -torch.rand(heads),
                                                        torch.randn(heads), 16, headdim=head_size)
    meta = dict(device="meta")
    out = tilegym_mamba2.mamba_split_conv1d_scan_combined(
        zxbcdt, weight.to(**meta), None, torch.empty(heads, **meta), torch.empty(heads, **meta),
        torch.empty(heads, **meta), 16, headdim=head_size)
    assert out.shape == (1, 10, dim) and out.device.type == "meta"
    with pytest.raises(ValueError, match=r"headdim \(8\) disagrees with D's \[nheads, headdim\] shape \(4, 9\)"):
        tilegym_mamba2.mamba_split_conv1d_scan_combined(
            zxbcdt, weight.to(**meta), None, torch.empty(heads, **meta), torch.empty(heads, **meta),
            torch.empty(heads, head_size + 1, **meta), 16, headdim=head_size)
