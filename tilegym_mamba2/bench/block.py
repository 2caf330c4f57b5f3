"""The whole Mamba-2 block's training step, ``mamba_split_conv1d_scan_combined`` (causal conv1d, the
scan, the gated RMSNorm and the output projection from the input projection's output, what
mamba_ssm's Mamba2 and Hugging Face's training path run): ``python -m tilegym_mamba2 bench --layer
--backward`` adds these rows after the layer op's.

The peer is the sequence of mamba_ssm's pieces that runs without the causal_conv1d CUDA extension
(its fused function needs it): the convolution in torch (``F.conv1d``, which has no sequence ids:
on packed rows it crosses sequence boundaries), mamba_ssm's ``mamba_chunk_scan_combined``, its
gated RMSNorm (``rmsnorm_fn``) and the output projection. Each row's floor is the step's memory
traffic at copy bandwidth: the input projection's output read by the forward and by the backward,
its gradient written, the block's output written and its gradient read, the output projection's
weight read twice and its gradient written.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockCase:
    name: str
    rows: int
    tokens: int
    d_model: int
    heads: int
    head_dim: int = 64
    state_size: int = 128
    groups: int = 1
    conv_width: int = 4
    sequences: int = 1  # > 1: that many random-length sequences packed in batch 1

    @property
    def d_inner(self):
        return self.heads * self.head_dim

    @property
    def width(self):  # zxbcdt's last dimension: z, xBC, dt
        return 2 * self.d_inner + 2 * self.groups * self.state_size + self.heads


BLOCK_CASES = [
    BlockCase("2.7B block, 2 rows of 8192", 2, 8192, 2560, 80),
    BlockCase("2.7B block, 64 packed sequences in 65536 tokens", 1, 65536, 2560, 80, sequences=64),
]
TRAINED = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "rmsnorm_weight", "outproj_weight")


def block_inputs(case: BlockCase, device="cuda", dtype=torch.bfloat16, seed=0):
    """Leaves of the block's call (requiring grad), its seq_idx (None unpacked), and dout."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(shape, generator=gen) * scale).to(device, dt).requires_grad_()

    conv_dim = case.d_inner + 2 * case.groups * case.state_size
    args = dict(
        zxbcdt=randn(case.rows, case.tokens, case.width),
        conv1d_weight=randn(conv_dim, case.conv_width, scale=0.5), conv1d_bias=randn(conv_dim, scale=0.1),
        dt_bias=(torch.rand(case.heads, generator=gen) * 4 - 4.5).to(device).requires_grad_(),
        A=(-torch.rand(case.heads, generator=gen) * 15 - 1).to(device).requires_grad_(),
        D=randn(case.heads, dt=torch.float32),
        rmsnorm_weight=(1 + 0.1 * torch.randn(case.d_inner, generator=gen)).to(device, dtype).requires_grad_(),
        outproj_weight=randn(case.d_model, case.d_inner, scale=case.d_inner ** -0.5))
    seq_idx = None
    if case.sequences > 1:
        cuts = torch.randperm(case.tokens - 1, generator=gen)[:case.sequences - 1].sort().values + 1
        seq_idx = torch.zeros(case.rows, case.tokens, dtype=torch.int32)
        for cut in cuts:
            seq_idx[:, cut:] += 1
        seq_idx = seq_idx.to(device)
    dout = torch.randn(case.rows, case.tokens, case.d_model, generator=gen).to(device, dtype)
    return args, seq_idx, dout


def ours(case, chunk_size=256):
    import tilegym_mamba2

    def run(args, seq_idx):
        return tilegym_mamba2.mamba_split_conv1d_scan_combined(
            **args, chunk_size=chunk_size, seq_idx=seq_idx, headdim=case.head_dim, ngroups=case.groups,
            norm_before_gate=False)
    return run


def mamba_ssm_pieces(case, chunk_size=256):
    """mamba_ssm's pieces in the fused function's order, the convolution in torch."""
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    def run(args, seq_idx):
        z, xbc, dt = torch.split(args["zxbcdt"], [case.d_inner, case.width - case.d_inner - case.heads, case.heads],
                                 dim=-1)
        conv = F.conv1d(xbc.transpose(1, 2), args["conv1d_weight"][:, None], args["conv1d_bias"],
                        padding=case.conv_width - 1, groups=xbc.shape[-1])[..., :case.tokens]
        xbc = F.silu(conv).transpose(1, 2)
        x, b, c = torch.split(xbc, [case.d_inner, case.groups * case.state_size, case.groups * case.state_size],
                              dim=-1)
        y = mamba_chunk_scan_combined(
            x.unflatten(-1, (case.heads, case.head_dim)), dt, args["A"], b.unflatten(-1, (case.groups, -1)),
            c.unflatten(-1, (case.groups, -1)), chunk_size, D=args["D"], dt_bias=args["dt_bias"], dt_softplus=True,
            seq_idx=seq_idx)
        y = rmsnorm_fn(y.flatten(-2), args["rmsnorm_weight"], None, z=z, eps=1e-6,
                       group_size=case.d_inner // case.groups, norm_before_gate=False)
        return F.linear(y, args["outproj_weight"])
    return run


def training_step(run):
    def step(args, seq_idx, dout):
        out = run(args, seq_idx)
        torch.autograd.grad(out, [args[name] for name in TRAINED], dout)
        return out.detach()
    return step


def floor_bytes(case, elem=2):
    activations = case.rows * case.tokens
    return elem * (3 * activations * case.width + 2 * activations * case.d_model + 3 * case.d_model * case.d_inner)


def run_block_bench(cases=BLOCK_CASES, log=print, device="cuda", timer=None):
    """-> rows: dict(case, impl, ms, floor_ms, note). ``timer(fn) -> ms`` (default: bench's measure,
    L2 flushed; the CPU tests pass their own)."""
    from .forward import copy_bandwidth, measure
    timer = timer or measure
    bandwidth = copy_bandwidth() if device == "cuda" else None
    rows = []
    for case in cases:
        args, seq_idx, dout = block_inputs(case, device)
        impls = {"ours": ours(case)}
        try:
            impls["mamba_ssm pieces"] = mamba_ssm_pieces(case)
        except Exception as e:  # not installed, or its imports fail here
            log(f"{case.name}: mamba_ssm pieces skipped ({type(e).__name__})")
        floor_ms = None if bandwidth is None else floor_bytes(case) / bandwidth * 1e3
        for name, run in impls.items():
            step = training_step(run)
            note = "conv crosses sequence boundaries (torch conv1d)" if name != "ours" and seq_idx is not None else ""
            try:
                ms = timer(lambda: step(args, seq_idx, dout))
            except Exception as e:  # noqa: BLE001 (a peer without this option)
                log(f"{case.name:50s} {name:18s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append(dict(case=case.name, impl=name, ms=ms, floor_ms=floor_ms, note=note))
            floor = "" if floor_ms is None else f"  (floor {floor_ms:.3f} ms, {ms / floor_ms:.1f}x)"
            log(f"{case.name:50s} {name:18s} fwd+bwd {ms:8.3f} ms{floor} {note}")
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows
