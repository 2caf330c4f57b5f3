"""mamba_ssm's ``mamba_split_conv1d_scan_combined``: a Mamba-2 mixer's training forward, from
its input projection's output to its output projection, differentiable.

    zxbcdt = [zx0 | z | xBC | dt]                   (zx0: 2 * d_nonssm extra MLP channels, usually none)
    xBC = act(causal depthwise conv1d(xBC))          x, B, C = split(xBC)
    y = mamba_chunk_scan_combined(x, dt, A, B, C, D, dt_bias, softplus, dt_limit, z when no norm)
    y = gated RMSNorm(y, z) in groups of dim / ngroups     (norm_before_gate: norm(y) * silu(z),
                                                             else norm(y * silu(z)), times the weight)
    out = outproj([silu(z0) * x0 | y])

It is a composition, not one fused kernel: the scan is our differentiable
mamba_chunk_scan_combined on the chosen backend (the time-consuming part); the convolution is
torch's depthwise conv1d (with packed sequences, the pytorch backend's causal_conv1d_fn, which
masks across sequence boundaries), since our convolution kernels have no backward; the norm and
the projections are torch's. HF transformers' Mamba-2 mixers call it in training mode
(integrations/hf/patch.py). Each backend module's registry target calls split_conv1d_scan with its
Backend object.
"""
import torch
import torch.nn.functional as F

from ..core.validation import ScanCombinedArgs
from ..runtime import limits
from ..serving.reference import causal_conv1d_reference
from ..serving.validation import CONV_WIDTHS, check_conv_args


def split_conv1d_scan(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                      seq_idx=None, dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                      rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                      ngroups=1, norm_before_gate=True, *, backend, conv=None, scan=None):
    """tilegym_mamba2.mamba_split_conv1d_scan_combined on ``backend`` (the scan's).

    Args (mamba_ssm's names):
        zxbcdt: [batch, seqlen, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads], dim = nheads * headdim.
        conv1d_weight: [dim + 2 * ngroups * dstate, width];  conv1d_bias: [dim + 2 * ngroups * dstate] or None.
        dt_bias: [nheads];  A: [nheads] (negative);  D: [nheads] (then headdim is needed) or [nheads, headdim].
        chunk_size: 16..256, a power of two.
        initial_states: [batch, nheads, headdim, dstate] or None;  seq_idx: [batch, seqlen] int or None.
        dt_limit: (low, high);  activation: None, "silu" or "swish" (of the convolution).
        rmsnorm_weight: [dim] or None (no norm: the scan gates by z);  rmsnorm_eps.
        outproj_weight: [out_dim, dim + d_nonssm] or None;  outproj_bias: [out_dim] or None.
        backend: the scan's Backend object (backends/base.py).
        conv, scan: stand-ins for the convolution (causal_conv1d_differentiable's arguments) and the
            scan (a ScanCombinedArgs -> its returns, as backend.scan_combined), for compositions that
            split the tokens over ranks (distributed/).

    Returns out [batch, seqlen, out_dim or dim + d_nonssm], and final_states
    [batch, nheads, headdim, dstate] fp32 with return_final_states.
    """
    nheads, headdim, dstate, d_nonssm = check_mixer_args(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, headdim,
                                                         ngroups, activation, rmsnorm_weight, outproj_weight,
                                                         outproj_bias, rmsnorm_eps, norm_before_gate)
    batch, seqlen, _ = zxbcdt.shape
    dim = nheads * headdim
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    conv = causal_conv1d_differentiable if conv is None else conv
    xBC = conv(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, activation=activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(batch, seqlen, nheads, headdim)
    B, C = B.reshape(batch, seqlen, ngroups, dstate), C.reshape(batch, seqlen, ngroups, dstate)
    z = z.reshape(batch, seqlen, nheads, headdim)
    call = ScanCombinedArgs(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk_size, D=D,
                            z=z if rmsnorm_weight is None else None, dt_bias=dt_bias, initial_states=initial_states,
                            seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
                            return_final_states=return_final_states)
    scanned = backend.scan_combined(call) if scan is None else scan(call)
    y, final_states = scanned if return_final_states else (scanned, None)
    y = y.reshape(batch, seqlen, dim)
    if rmsnorm_weight is not None:
        y = _gated_rms_norm(y, z.reshape(batch, seqlen, dim), rmsnorm_weight, rmsnorm_eps, dim // ngroups,
                            norm_before_gate)
    if d_nonssm:
        z0, x0 = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    if outproj_weight is not None:  # in the activations' dtype, as under autocast
        y = F.linear(y, outproj_weight.to(y.dtype), None if outproj_bias is None else outproj_bias.to(y.dtype))
    return (y, final_states) if return_final_states else y


def causal_conv1d_differentiable(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                                 final_states_out=None, activation=None):
    """causal_conv1d_fn's call (x [batch, dim, seqlen]), differentiable: torch's depthwise conv1d
    where it applies, the pytorch backend's causal_conv1d_fn with packed sequences or states (our
    cuTile convolution has no backward). Training paths use it (here and integrations/hf/patch.py)."""
    if seq_idx is not None or initial_states is not None or return_final_states:
        return causal_conv1d_reference(check_conv_args(x, weight, bias, seq_idx, initial_states, return_final_states,
                                                       final_states_out, activation, limits=limits.PYTORCH))
    # In the wider of the two dtypes (a bf16 model's own conv runs in bf16; fp32 weights keep fp32).
    dtype = torch.promote_types(x.dtype, weight.dtype)
    width = weight.shape[1]
    out = F.conv1d(x.to(dtype), weight[:, None, :].to(dtype), None if bias is None else bias.to(dtype),
                   padding=width - 1, groups=weight.shape[0])[..., :x.shape[2]]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def _gated_rms_norm(y, z, weight, eps, group_size, norm_before_gate):
    """RMSNorm over groups of ``group_size`` channels, gated by silu(z) before or after, in fp32
    (fp64 for fp64); the result in y's dtype."""
    shape = y.shape
    dtype = torch.promote_types(y.dtype, torch.float32)
    v = y.to(dtype)
    gate = F.silu(z.to(dtype))
    if not norm_before_gate:
        v = v * gate
    grouped = v.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    v = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)).reshape(shape) * weight.to(dtype)
    if norm_before_gate:
        v = v * gate
    return v.to(y.dtype)


def check_mixer_args(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, headdim, ngroups, activation, rmsnorm_weight,
                     outproj_weight, outproj_bias, rmsnorm_eps=1e-6, norm_before_gate=True):
    """-> (nheads, headdim, dstate, d_nonssm); ValueError/TypeError naming the argument otherwise.
    The scan's own arguments are checked again by mamba_chunk_scan_combined."""
    for name, t in (("zxbcdt", zxbcdt), ("conv1d_weight", conv1d_weight), ("dt_bias", dt_bias), ("A", A),
                    ("D", D), ("conv1d_bias", conv1d_bias), ("rmsnorm_weight", rmsnorm_weight),
                    ("outproj_weight", outproj_weight), ("outproj_bias", outproj_bias)):
        optional = name in ("conv1d_bias", "rmsnorm_weight", "outproj_weight", "outproj_bias")
        if not isinstance(t, torch.Tensor) and not (optional and t is None):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")
    if isinstance(rmsnorm_eps, bool) or not isinstance(rmsnorm_eps, (int, float)):
        raise TypeError(f"rmsnorm_eps must be a positive number, got {type(rmsnorm_eps).__name__} {rmsnorm_eps!r}")
    if not 0 < rmsnorm_eps < float("inf"):
        raise ValueError(f"rmsnorm_eps must be a positive finite number, got {rmsnorm_eps!r}")
    if not isinstance(norm_before_gate, bool):
        raise TypeError(f"norm_before_gate must be True or False, got {norm_before_gate!r}")
    for name, value in (("headdim", headdim), ("ngroups", ngroups)):
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if zxbcdt.ndim != 3 or min(zxbcdt.shape[:2]) < 1:
        raise ValueError(f"zxbcdt must be [batch, seqlen, channels] with batch and seqlen at least 1, "
                         f"got shape {tuple(zxbcdt.shape)}")
    if not zxbcdt.is_floating_point():  # else the convolution's check would name its input x
        raise TypeError(f"zxbcdt must be a floating-point tensor (bfloat16, float16, float32 or float64), "
                        f"got {zxbcdt.dtype}")
    # One device, checked here under the caller's names (the scan would name the slices of zxbcdt).
    elsewhere = [f"{name} on {t.device}" for name, t in (
        ("conv1d_weight", conv1d_weight), ("conv1d_bias", conv1d_bias), ("dt_bias", dt_bias), ("A", A), ("D", D),
        ("rmsnorm_weight", rmsnorm_weight), ("outproj_weight", outproj_weight),
        ("outproj_bias", outproj_bias)) if t is not None and t.device != zxbcdt.device]
    if elsewhere:
        raise ValueError(f"all tensors must be on zxbcdt's device ({zxbcdt.device}), got {', '.join(elsewhere)}")
    for name, t in (("zxbcdt", zxbcdt), ("conv1d_weight", conv1d_weight), ("dt_bias", dt_bias), ("A", A), ("D", D),
                    ("conv1d_bias", conv1d_bias), ("rmsnorm_weight", rmsnorm_weight),
                    ("outproj_weight", outproj_weight), ("outproj_bias", outproj_bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if D.ndim not in (1, 2):
        raise ValueError(f"D must be [nheads] or [nheads, headdim], got shape {tuple(D.shape)}")
    # nheads: what most of A, dt_bias and D say (A's on a tie), so that the odd one out is named
    sizes = [t.shape[0] for t in (A, dt_bias, D) if t.ndim >= 1]
    nheads = max(sizes, key=lambda n: (sizes.count(n), n == sizes[0]))
    for name, t in (("dt_bias", dt_bias), ("A", A)):
        if tuple(t.shape) != (nheads,):
            raise ValueError(f"{name} must be [nheads] = ({nheads},), got shape {tuple(t.shape)}")
    if D.shape[0] != nheads:
        raise ValueError(f"D must be [nheads] or [nheads, headdim] with nheads = {nheads} (A's and dt_bias'), "
                         f"got shape {tuple(D.shape)}")
    if D.ndim == 1:
        if not isinstance(headdim, int) or headdim < 1:
            raise ValueError(f"headdim must be a positive int when D is [nheads], got {headdim!r}")
    elif headdim is not None and headdim != D.shape[1]:
        raise ValueError(f"headdim ({headdim}) disagrees with D's [nheads, headdim] shape {tuple(D.shape)}")
    else:
        headdim = D.shape[1]
    if not isinstance(ngroups, int) or ngroups < 1 or nheads % ngroups:
        raise ValueError(f"ngroups must be a positive int dividing nheads ({nheads}), got {ngroups!r}")
    dim = nheads * headdim
    if (conv1d_weight.ndim != 2 or (conv1d_weight.shape[0] - dim) <= 0
            or (conv1d_weight.shape[0] - dim) % (2 * ngroups) or conv1d_weight.shape[1] not in CONV_WIDTHS):
        raise ValueError(f"conv1d_weight must be [dim + 2 * ngroups * dstate, width] with dim = {dim}, "
                         f"ngroups = {ngroups} and width one of {CONV_WIDTHS} (causal_conv1d's), got shape "
                         f"{tuple(conv1d_weight.shape)}")
    dstate = (conv1d_weight.shape[0] - dim) // (2 * ngroups)
    extra = zxbcdt.shape[2] - 2 * dim - 2 * ngroups * dstate - nheads
    if extra < 0 or extra % 2:
        raise ValueError(f"zxbcdt's last dimension must be 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads "
                         f"= 2 * d_nonssm + {2 * dim + 2 * ngroups * dstate + nheads}, got {zxbcdt.shape[2]}")
    if conv1d_bias is not None and tuple(conv1d_bias.shape) != (conv1d_weight.shape[0],):
        raise ValueError(f"conv1d_bias must be [{conv1d_weight.shape[0]}], got shape {tuple(conv1d_bias.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if rmsnorm_weight is not None and tuple(rmsnorm_weight.shape) != (dim,):
        raise ValueError(f"rmsnorm_weight must be [dim] = ({dim},), got shape {tuple(rmsnorm_weight.shape)}")
    if outproj_weight is None:
        if outproj_bias is not None:
            raise ValueError("outproj_bias needs outproj_weight")
    elif outproj_weight.ndim != 2 or outproj_weight.shape[1] != dim + extra // 2:
        # Its width is dim + d_nonssm, and d_nonssm comes from zxbcdt: either may be the one at fault.
        raise ValueError(f"outproj_weight must be [out_dim, dim + d_nonssm] = [out_dim, {dim + extra // 2}] with "
                         f"d_nonssm = {extra // 2} from zxbcdt's last dimension ({zxbcdt.shape[2]}), got shape "
                         f"{tuple(outproj_weight.shape)}: one of outproj_weight and zxbcdt is the wrong width")
    elif outproj_bias is not None and tuple(outproj_bias.shape) != (outproj_weight.shape[0],):
        raise ValueError(f"outproj_bias must be [out_dim] = ({outproj_weight.shape[0]},) (outproj_weight's rows), "
                         f"got shape {tuple(outproj_bias.shape)}")
    return nheads, headdim, dstate, extra // 2
