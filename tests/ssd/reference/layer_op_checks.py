"""The CPU layer-op tests' inputs and their check against the float64 definition: small
mamba_ssm-layout inputs, each option's value, packing helpers, mamba_ssm's return convention."""
import torch
import torch.nn.functional as F

import tilegym_mamba2
from tilegym_mamba2.ssd.reference.layer import layer_token_recurrence
from tilegym_mamba2.testing import relative_error as rel_err

HEADS, HEAD_SIZE, STATE, GROUPS = 4, 8, 16, 2
TOL_FP32 = 1e-5
TOL_BF16 = 1e-2
RETURN_FLAGS = ("return_final_states", "return_varlen_states")


def make_inputs(batch=1, tokens=100, heads=HEADS, head_size=HEAD_SIZE, state=STATE, groups=GROUPS,
                dtype=torch.float32, raw_dt=False, seed=0):
    """mamba_ssm's layouts. dt is positive unless raw_dt (then it straddles 0, as before a softplus)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    dt = randn(batch, tokens, heads) - 1.0 if raw_dt else F.softplus(randn(batch, tokens, heads) - 2.0)
    return dict(
        x=randn(batch, tokens, heads, head_size).to(dtype),
        dt=dt.to(dtype),
        A=-(0.5 + 4 * torch.rand(heads, generator=gen)),
        B=randn(batch, tokens, groups, state).to(dtype),
        C=randn(batch, tokens, groups, state).to(dtype),
    )


def option(name, inputs, gen):
    """A value for one option, sized for ``inputs``."""
    batch, tokens, heads, head_size = inputs["x"].shape
    state = inputs["B"].shape[-1]
    if name == "D_head":
        return {"D": torch.randn(heads, generator=gen)}
    if name == "D_channel":
        return {"D": torch.randn(heads, head_size, generator=gen)}
    if name == "z":
        return {"z": torch.randn(batch, tokens, heads, head_size, generator=gen).to(inputs["x"].dtype)}
    if name == "dt_bias":
        return {"dt_bias": torch.randn(heads, generator=gen) * 0.5}
    if name == "dt_softplus":
        return {"dt_softplus": True}
    if name == "dt_limit":
        return {"dt_limit": (0.05, 0.2)}
    if name == "initial_states":
        return {"initial_states": torch.randn(batch, heads, head_size, state, generator=gen)}
    raise KeyError(name)


def lengths_to_cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def random_lengths(num, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (num,), generator=gen).tolist()


def seq_idx_rows(*row_lengths):
    """Per batch row, the lengths of its sequences -> seq_idx [batch, tokens] int32 (ids from 0)."""
    rows = [torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
            for lens in row_lengths]
    return torch.stack(rows)


def unpack(result, return_final_states, return_varlen_states):
    """mamba_ssm's convention -> (out, final_states or None, varlen_states or None), checking the structure."""
    if not return_final_states and not return_varlen_states:
        assert isinstance(result, torch.Tensor)
        return result, None, None
    assert isinstance(result, tuple)
    assert len(result) == 1 + return_final_states + return_varlen_states
    out, *rest = result
    final = rest.pop(0) if return_final_states else None
    varlen = rest.pop(0) if return_varlen_states else None
    return out, final, varlen


def run_and_compare(inputs, chunk_size, tol=TOL_FP32, **options):
    """The public function on the pytorch backend against layer_token_recurrence; returns both."""
    flags = {k: options.pop(k, False) for k in RETURN_FLAGS}
    result = tilegym_mamba2.mamba_chunk_scan_combined(**inputs, chunk_size=chunk_size, **options, **flags,
                                                      backend="pytorch")
    out, final, varlen = unpack(result, **flags)
    ref_out, ref_final, ref_varlen = layer_token_recurrence(**inputs, **options)
    assert out.shape == inputs["x"].shape and out.dtype == inputs["x"].dtype
    assert rel_err(out, ref_out) < tol, f"out: {rel_err(out, ref_out):.3g}"
    if flags["return_final_states"]:
        assert final.dtype == torch.float32 and final.shape == ref_final.shape
        assert rel_err(final, ref_final) < tol, f"final_states: {rel_err(final, ref_final):.3g}"
    if flags["return_varlen_states"]:
        assert varlen.dtype == inputs["C"].dtype and varlen.shape == ref_varlen.shape  # C's dtype, as mamba_ssm
        assert rel_err(varlen, ref_varlen) < tol, f"varlen_states: {rel_err(varlen, ref_varlen):.3g}"
    return (out, final, varlen), (ref_out, ref_final, ref_varlen)



def all_options(inputs, gen):
    opts = {}
    for name in ("D_channel", "z", "dt_bias", "dt_softplus"):
        opts.update(option(name, inputs, gen))
    opts["dt_limit"] = (0.01, 0.8)
    return opts

