"""Experiment 42 (CPU, no GPU): cutile/chunk_grads.py's decay gradient dl, and the state pass
that feeds it, emulated in float64 with mantissa rounding (bf16 8 bits, tf32 11) at the points
where the kernels round mma operands; dA's error against float64 autograd of the layer reference
per rounding configuration, over seeds. Cases are test_backward_gpu.py's (on a CPU generator).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/variants/dl_rounding_emulation.py seq_idx 1,2,3 [tokens]
    (cases: seq_idx, seq_noinit, plain, mixer; `where_dy` for experiment 48, `through` for 63)
"""
import math, sys
import torch
from tilegym_mamba2.backward import Kernels, scan_backward
from tilegym_mamba2.scan_reference import _chunked, _chunked_sequences
from tilegym_mamba2.layer_reference import chunked_layer_reference, process_dt

torch.set_num_threads(1)
F64 = torch.float64
REF = torch.float64
L = 64

def rnd(t, bits):
    """round to `bits` significant bits (bf16: 8, tf32: 11, fp32: 24), nearest-even; None = exact"""
    if bits is None:
        return t
    m, e = torch.frexp(t)
    return torch.ldexp(torch.round(torch.ldexp(m, torch.full_like(e, bits))), e - bits)

# rounding config: dict with keys 'state' (entry state in from_state), 'grad' (dS in to_grad),
# 'pass' (b*weight in both state passes), 'dy' (dy to bf16 in the layer, mixer case only; or, for
# experiment 48, only where one place uses it: 'dy_scan' the reversed scan's input, 'dy_products'
# chunk_grads' dy . x products, 'dy_received' its dy . (c S) terms)
CFG = {}

def entry_states(x, b, weight, log_decay, init, seq_idx):
    """chunk_entry_states with the state pass's rounding of (b * weight) (fwd_pass_state.py)."""
    batch, tokens, heads, P = x.shape
    chunks = -(-tokens // L)
    xc, bc = _chunked(x, L, F64), _chunked(b.repeat_interleave(heads // b.shape[2], 2), L, F64)
    w, g = _chunked(weight, L, F64), _chunked(log_decay, L, F64).cumsum(2)
    g_end = g[:, :, -1]
    seq = _chunked_sequences(seq_idx, x, L)
    end_seq = seq[:, :, -1:]
    before = torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], 1)
    weights = w * torch.exp(g_end[:, :, None] - g) * (seq == end_seq)[..., None]   # [B,K,L,H]
    bw = rnd(bc * weights[..., None], CFG.get('pass'))                             # [B,K,L,H,N]
    local = torch.einsum("bklhn,bklhp->bkhpn", bw, xc)
    keep = torch.exp(g_end) * (before == end_seq[..., 0])[..., None]
    state = torch.zeros(batch, heads, P, b.shape[3], dtype=F64)
    if init is not None:
        state = init.to(F64) * (seq[:, 0, 0] == 0)[:, None, None, None]
    entries = []
    for k in range(chunks):
        entries.append(state)
        state = keep[:, k, :, None, None] * state + local[:, k]
    return torch.stack(entries, 1), state

def scan(x, b, c, weight, log_decay, init=None, seq_idx=None, cu_seqlens=None, outputs=False):
    assert cu_seqlens is None
    # x is dy in the reversed scan; the forward's x is bf16 already, so rounding it changes nothing
    ent, final = entry_states(rnd(x, CFG.get('dy_scan')), b, weight, log_decay, init, seq_idx)
    return None, final, None, (ent, weight, log_decay)

def chunk_grads(x, b, c, dy, a, seq_idx, fwd, rev, skip, dy_low=None):  # dy_low: the CFG's roundings stand in
    """The kernel's dl formulas, vectorised over batch, chunk, head; ddt holds a dl only and dA is
    sum(dt dl), as the rows kernel stores them (dx, db, dc and x . dh b are not emulated)."""
    entry, weight, log_decay = fwd
    rev_entry, _, rev_decay = rev
    chunks = entry.shape[1]
    first = rev_decay[:, ::L][:, :chunks]
    ends = (torch.exp(first)[..., None, None] * rev_entry).flip(1)               # grad_t (fp32 in kernel)
    batch, tokens, heads, _ = x.shape
    rep = heads // b.shape[2]
    xc, dyc = _chunked(x, L, F64), _chunked(rnd(dy, CFG.get('dy_products')), L, F64)
    dyc_received = _chunked(rnd(dy, CFG.get('dy_received')), L, F64)
    bc, cc = _chunked(b.repeat_interleave(rep, 2), L, F64), _chunked(c.repeat_interleave(rep, 2), L, F64)
    w, g = _chunked(weight, L, F64), _chunked(log_decay, L, F64).cumsum(2)
    g_end = g[:, :, -1:]
    seq = _chunked_sequences(seq_idx, x, L)
    carried = (torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], 1)[..., None] == seq)[..., None]
    going_on = (torch.cat([seq[:, 1:, 0], seq[:, -1:, -1]], 1)[..., None] == seq)[..., None]
    same = (seq[..., :, None] == seq[..., None, :])[:, :, None]
    at_or_before = torch.ones(L, L, dtype=torch.bool).tril()
    gh = g.permute(0, 1, 3, 2)
    decay = torch.exp((gh[..., :, None] - gh[..., None, :]).masked_fill(~(at_or_before & same), -math.inf))
    scores = torch.einsum("bkthn,bkshn->bkhts", cc, bc)
    products = torch.einsum("bkthp,bkshp->bkhts", dyc, xc)
    from_end = torch.exp(g_end - g) * going_on
    into = torch.exp(g) * carried
    pairs = decay * products * w.permute(0, 1, 3, 2)[..., None, :] * scores
    before_u = pairs.cumsum(-1) - pairs
    dl = (before_u * at_or_before).sum(-2).permute(0, 1, 3, 2)
    # from_state = c @ S.astype(bf16); received = into * sum(dy * from_state)
    from_state = torch.einsum("bklhn,bkhpn->bklhp", cc, rnd(entry, CFG.get('state')))
    received = into * (dyc_received * from_state).sum(-1)
    dl = dl + received.sum(2, keepdim=True) - received.cumsum(2) + received
    # to_grad = b @ dS.astype(bf16); sent = dt * from_end * sum(x * to_grad)
    to_grad = torch.einsum("bklhn,bkhpn->bklhp", bc, rnd(ends, CFG.get('grad')))
    sent = w * from_end * (xc * to_grad).sum(-1)
    dl = dl + sent.cumsum(2) - sent
    # 'through': both states rounded for <dS, S> as well (experiment 63: the walks store them in
    # the mma dtype, the reverse walk's already scaled into the next chunk, as `ends` here)
    through = torch.exp(g_end) * (rnd(ends, CFG.get('through')) * rnd(entry, CFG.get('through'))).sum((-1, -2))[:, :, None]
    dl = dl + through * (carried & going_on)
    dl = dl.reshape(batch, chunks * L, heads)[:, :tokens]
    CFG['_parts'] = (received, sent, through * (carried & going_on), dl)
    return (torch.zeros_like(x), a * dl, (weight * dl).sum((0, 1)), torch.zeros_like(b), torch.zeros_like(c),
            None)

KERNELS = Kernels(scan, chunk_grads, L)

def make_case(name, seed, batch=2, tokens=2048, heads=8, state=128, head=64):
    g = torch.Generator().manual_seed(seed)
    bf = lambda t: t.to(torch.bfloat16).to(F64)
    randn = lambda *s: torch.randn(*s, generator=g)
    x = bf(torch.nn.functional.silu(randn(batch, tokens, heads, head)))
    B = bf(torch.nn.functional.silu(randn(batch, tokens, 1, state)))
    C = bf(torch.nn.functional.silu(randn(batch, tokens, 1, state)))
    A = (-(1 + 15 * torch.rand(heads, generator=g))).to(F64)
    dt_raw = (randn(batch, tokens, heads) - 2).to(F64)
    kw = dict(D=randn(heads).to(F64))
    if name in ("seq_idx", "seq_noinit", "init_only"):
        cuts = torch.tensor([tokens // 5, tokens // 2, tokens - 3])
        seq = (torch.arange(tokens)[None] >= cuts[:, None]).sum(0).to(torch.int32)
        if name != "init_only":
            kw["seq_idx"] = torch.stack([seq, seq.clamp(min=1)])[:batch].contiguous()
        if name != "seq_noinit":
            kw["initial_states"] = (0.1 * randn(batch, heads, head, state)).to(F64)
        dt = process_dt(dt_raw, None, True, dtype=F64)
    elif name.startswith("mixer"):
        kw["z"] = bf(randn(batch, tokens, heads, head))
        dt_bias = (randn(heads) - 1).to(F64)
        dt = process_dt(dt_raw, dt_bias, True, dtype=F64)
    else:  # plain: no init, no seq_idx, no z
        dt = process_dt(dt_raw, None, True, dtype=F64)
    if name == "seq_noinit":
        pass
    dout = bf(randn(batch, tokens, heads, head))
    return x, dt, A, B, C, kw, dout

def reference_dA(x, dt, A, B, C, kw, dout):
    Al = A.clone().requires_grad_()
    out = chunked_layer_reference(x, dt, Al, B, C, kw.get("D"), kw.get("z"), kw.get("initial_states"),
                                  kw.get("seq_idx"), None, chunk_size=64)[0]
    return torch.autograd.grad((out * dout).sum(), Al)[0]

def emulated_dA(x, dt, A, B, C, kw, dout, cfg):
    global F64
    CFG.clear(); CFG.update(cfg)
    F64 = torch.float32 if cfg.get('fp32') else REF
    x, dt, A, B, C, dout = (t.to(F64) for t in (x, dt, A, B, C, dout))
    kw = {k: (v.to(F64) if v.is_floating_point() else v) for k, v in kw.items()}
    dy = dout
    if kw.get("z") is not None:
        z = kw["z"]
        dy = dout * z * torch.sigmoid(z)
        dy = rnd(dy, cfg.get('dy'))
    res = scan_backward(KERNELS, x, A, B, C, dt, dy, None, initial_states=kw.get("initial_states"),
                        seq_idx=kw.get("seq_idx"))
    F64 = REF
    return res[4].to(REF)  # (dx, dB, dC, ddt, dA, ...)

def rel(a, r):
    return ((a - r).norm() / r.norm()).item()

def where_dy_rounds(seeds, tokens):
    """Experiment 48: the mixer case with the state roundings on and the gated dy rounded to bf16
    in one place at a time, or kept to 16 bits (two bf16 terms) in chunk_grads."""
    BF, HI_LO = 8, 16
    base = dict(state=BF, grad=BF, **{'pass': BF})
    configs = {"dy bf16 everywhere (main)": dict(base, dy=BF),
               "dy bf16 in the reversed scan only": dict(base, dy_scan=BF),
               "... and in chunk_grads' products": dict(base, dy_scan=BF, dy_products=BF),
               "... and in chunk_grads' received terms": dict(base, dy_scan=BF, dy_received=BF),
               "scan bf16, chunk_grads hi/lo (16 bits)": dict(base, dy_scan=BF, dy_products=HI_LO, dy_received=HI_LO),
               "no dy rounding": dict(base)}
    dA_table("mixer", configs, seeds, tokens)


def dA_table(name, configs, seeds, tokens):
    """dA's error against float64 autograd per rounding configuration: rms and max over the seeds
    of the relative error, and the worst single head."""
    results = {k: [] for k in configs}
    for seed in seeds:
        case = make_case(name, seed, tokens=tokens)
        ref = reference_dA(*case)
        for k, cfg in configs.items():
            got = emulated_dA(*case, cfg)
            results[k].append((rel(got, ref), ((got - ref).abs() / ref.abs()).max().item()))
    print(f"== {name} tokens={tokens} seeds={seeds}: dA rel err, rms / max over seeds, worst single head")
    for k, v in results.items():
        rms = (sum(e * e for e, _ in v) / len(v)) ** 0.5
        print(f"  {k:40s} {rms:.2e} / {max(e for e, _ in v):.2e}   {max(h for _, h in v):.2e}", flush=True)


def through_rounds(seeds, tokens):
    """Experiment 63: the kernels' roundings as they are, against the same with <dS, S> taken from
    bf16 states (the walks storing their states in the mma dtype), per case."""
    BF, HI_LO = 8, 16
    for name in ("plain", "init_only", "mixer"):
        base = dict(state=BF, grad=BF, **{'pass': BF})
        if name == "mixer":
            base.update(dy_scan=BF, dy_products=HI_LO, dy_received=HI_LO)
        configs = {"as the kernels are": base, "<dS, S> from bf16 states": dict(base, through=BF),
                   "exact (no rounding)": {}}
        dA_table(name, configs, seeds, tokens)


if __name__ == "__main__":
    if sys.argv[1] == "through":
        sys.exit(through_rounds([int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]) if len(sys.argv) > 3 else 2048))
    if sys.argv[1] == "where_dy":
        sys.exit(where_dy_rounds([int(s) for s in sys.argv[2].split(",")], int(sys.argv[3]) if len(sys.argv) > 3 else 2048))
    name = sys.argv[1]
    seeds = [int(s) for s in sys.argv[2].split(",")]
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    BF, TF, F32 = 8, 11, 24
    configs = {
        "exact": {},
        "state": dict(state=BF), "grad": dict(grad=BF), "pass": dict(**{'pass': BF}), "dy": dict(dy=BF),
        "state+grad": dict(state=BF, grad=BF),
        "all (state,grad,pass,dy)": dict(state=BF, grad=BF, dy=BF, **{'pass': BF}),
        "all but state": dict(grad=BF, dy=BF, **{'pass': BF}),
        "all but grad": dict(state=BF, dy=BF, **{'pass': BF}),
        "all but pass": dict(state=BF, grad=BF, dy=BF),
        "all, state tf32": dict(state=TF, grad=BF, dy=BF, **{'pass': BF}),
        "all, state fp32": dict(state=F32, grad=BF, dy=BF, **{'pass': BF}),
        "all, state+grad tf32": dict(state=TF, grad=TF, dy=BF, **{'pass': BF}),
        "fp32 compute, no bf16": dict(fp32=True),
        "fp32 compute + all bf16": dict(fp32=True, state=BF, grad=BF, dy=BF, **{'pass': BF}),
        "all tf32 (state,grad,pass)": dict(state=TF, grad=TF, dy=BF, **{'pass': TF}),
    }
    if name != "mixer":
        configs = {k: {kk: vv for kk, vv in v.items() if kk != 'dy'} for k, v in configs.items() if k != "dy"}
    results = {k: [] for k in configs}
    for seed in seeds:
        case = make_case(name, seed, tokens=tokens)
        ref = reference_dA(*case)
        for k, cfg in configs.items():
            results[k].append(rel(emulated_dA(*case, cfg), ref))
        print(f"seed {seed}: " + " ".join(f"{k}={v[-1]:.2e}" for k, v in results.items()), flush=True)
    print(f"== {name} tokens={tokens} seeds={seeds}: rms / median / max rel err of dA")
    for k, v in results.items():
        rms = (sum(e * e for e in v) / len(v)) ** 0.5
        print(f"  {k:28s} {rms:.2e}  {sorted(v)[len(v)//2]:.2e}  {max(v):.2e}")
