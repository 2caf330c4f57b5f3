"""The serving ops in plain PyTorch, float64-checkable: what the "pytorch" backend runs on checked
arguments (backends/pytorch.py checks them with serving/validation.py).

* ``selective_state_update_reference``: one decode step of the selective state space recurrence,
  mamba_ssm's ``selective_state_update``:
      dt = softplus?(dt + dt_bias)      (softplus passes values above 20 through)
      state = exp(A dt) state + dt x B^T            (updated in place)
      out = state C + D x,  out *= silu(z)
* ``causal_conv1d_reference``: the depthwise causal convolution of causal_conv1d's
  ``causal_conv1d_fn``: out[t] = bias + sum_w weight[w] x[t - (width-1) + w], then silu if asked.
* ``causal_conv1d_update_reference``: the same convolution one (or a few) tokens at a time against a
  rolling (or, with cache_seqlens, circular) conv_state, causal_conv1d's ``causal_conv1d_update``.
* ``rms_norm_reference``: Hugging Face's Mamba-2 RMSNorm and gated RMSNorm, per group of the last
  dimension: h = x * silu(gate); h = h / sqrt(mean(h^2) + eps); out = weight * h rounded to x's dtype.

Continuous batching: with ``state_batch_indices`` / ``conv_state_indices``, batch row i uses state
row ``indices[i]``; a negative index marks a padding row: its output is zeros and no state is
written (mamba_ssm's and causal_conv1d's rule), and so does an index past the last state row (the
checks refuse it where the indices are on the host). Rows must use distinct state rows.

Arithmetic is in float64 when any input is float64, else in float32. Nothing reads tensor values
on the host, so these run inside a CUDA graph capture too.
"""
import torch
import torch.nn.functional as F

from ..core.constants import SOFTPLUS_THRESHOLD
from ..core.tensors import compute_dtype



def selective_state_update_reference(args):
    """mamba_ssm's selective_state_update on checked arguments (serving_validation.StateUpdateArgs):
    updates ``state`` in place, returns out in x's dtype."""
    state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, indices, has_heads = args
    f = compute_dtype(state, x, dt, A, B, C, D, z, dt_bias)
    heads, groups = state.shape[1], B.shape[1]
    slots, valid = _rows(indices, x.shape[0], state.shape[0], x.device)

    dt = dt.to(f)
    if dt_bias is not None:
        dt = dt + dt_bias.to(f)
    if dt_softplus:
        dt = F.softplus(dt, threshold=SOFTPLUS_THRESHOLD)
    x_f = x.to(f)
    B = B.to(f).repeat_interleave(heads // groups, dim=1)              # [batch, heads, state_size]
    C = C.to(f).repeat_interleave(heads // groups, dim=1)
    old = state[slots].to(f)                                           # [batch, heads, head_size, state_size]
    new = torch.exp(A.to(f) * dt[..., None]) * old + (dt * x_f)[..., None] * B[:, :, None, :]
    out = (new * C[:, :, None, :]).sum(-1)
    if D is not None:
        out = out + D.to(f) * x_f
    if z is not None:
        out = out * F.silu(z.to(f))
    out = torch.where(valid[:, None, None], out, 0.0)
    _write_rows(state, slots, valid, new)
    out = out.to(x.dtype)
    return out if has_heads else out.squeeze(1)


def causal_conv1d_reference(args):
    """causal_conv1d's causal_conv1d_fn on checked arguments (serving_validation.ConvArgs):
    x [batch, dim, seqlen] -> out like x (x's dtype), and
    with return_final_states the last width - 1 inputs [batch, dim, width - 1] (written into
    final_states_out when given). With seq_idx, a token sees only earlier tokens of its own
    sequence; tokens with a negative seq_idx are padding and give 0."""
    x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, silu = args
    f = compute_dtype(x, weight, bias, initial_states)
    batch, dim, tokens = x.shape
    width = weight.shape[1]
    history = (initial_states.to(f) if initial_states is not None
               else torch.zeros(batch, dim, width - 1, dtype=f, device=x.device))
    padded = torch.cat([history, x.to(f)], dim=-1)                     # [batch, dim, width - 1 + tokens]
    if seq_idx is None:
        out = _convolve(padded, weight.to(f), tokens)
    else:
        # A token sees inputs of its own sequence only; positions before the row start are in none (-1).
        # Selected, not multiplied by a 0/1 mask: an input of another sequence or of padding
        # (NaN or inf included) contributes an exact 0.
        seq = torch.cat([torch.full((batch, width - 1), -1, dtype=seq_idx.dtype, device=x.device), seq_idx], -1)
        same = torch.stack([seq[:, w:w + tokens] == seq_idx for w in range(width)], dim=-1)  # [batch, tokens, width]
        out = sum(torch.where(same[:, None, :, w], weight[:, w].to(f)[None, :, None] * padded[..., w:w + tokens], 0.0)
                  for w in range(width))
    if bias is not None:
        out = out + bias.to(f)[None, :, None]
    if silu:
        out = F.silu(out)
    if seq_idx is not None:
        out = torch.where(seq_idx[:, None, :] >= 0, out, 0.0)
    out = torch.empty_like(x).copy_(out)                               # x's dtype and layout
    if not return_final_states:
        return out
    final = padded[..., tokens:]                                       # the last width - 1 inputs
    if final_states_out is None:
        return out, final.to(x.dtype)
    final_states_out.copy_(final)
    return out, final_states_out


def causal_conv1d_update_reference(args):
    """causal_conv1d's causal_conv1d_update on checked arguments (serving_validation.ConvUpdateArgs):
    x [batch, dim] or [batch, dim, seqlen] -> out like x;
    conv_state [slots, dim, state_len] updated in place. Without cache_seqlens it rolls: it
    becomes the last state_len entries of (conv_state, x). With cache_seqlens it is a circular
    buffer: x goes to positions cache_seqlens % state_len onwards, and the width - 1 entries before
    that position are the convolution's history."""
    x3, conv_state, weight, bias, silu, cache_seqlens, indices, squeeze = args
    f = compute_dtype(x3, conv_state, weight, bias)
    batch, dim, tokens = x3.shape
    width, state_len = weight.shape[1], conv_state.shape[2]
    slots, valid = _rows(indices, batch, conv_state.shape[0], x3.device)
    old = conv_state[slots]                                            # [batch, dim, state_len]
    x_f = x3.to(f)
    if cache_seqlens is None:
        history = old[..., state_len - (width - 1):].to(f)
        new = torch.cat([old, x3.to(old.dtype)], dim=-1)[..., tokens:]
    else:
        start = cache_seqlens.long() % state_len                       # [batch]
        read = (start[:, None] + torch.arange(-(width - 1), 0, device=x3.device)) % state_len
        history = old.gather(2, read[:, None, :].expand(-1, dim, -1)).to(f)
        # Position p receives x[i] for (start + i) % state_len == p; the last such i wins.
        offset = (torch.arange(state_len, device=x3.device) - start[:, None]) % state_len  # [batch, state_len]
        last = offset + (tokens - 1 - offset).clamp_min(0) // state_len * state_len
        written = x3.gather(2, last.clamp(max=tokens - 1)[:, None, :].expand(-1, dim, -1)).to(old.dtype)
        new = torch.where((offset < tokens)[:, None, :], written, old)
    out = _convolve(torch.cat([history, x_f], dim=-1), weight.to(f), tokens)
    if bias is not None:
        out = out + bias.to(f)[None, :, None]
    if silu:
        out = F.silu(out)
    out = torch.where(valid[:, None, None], out, 0.0).to(x3.dtype)
    _write_rows(conv_state, slots, valid, new)
    return out.squeeze(-1) if squeeze else out


def _convolve(padded, weight, tokens):
    """padded [batch, dim, width - 1 + tokens], weight [dim, width] -> [batch, dim, tokens]."""
    width = weight.shape[1]
    return sum(weight[:, w][None, :, None] * padded[..., w:w + tokens] for w in range(width))


def _rows(indices, batch, slots, device):
    """-> (state row of each batch row, clamped to a valid row for padding rows; is it real).
    An index past the last slot is a padding row too: nothing out of bounds is read or written."""
    if indices is None:
        return torch.arange(batch, device=device), torch.ones(batch, dtype=torch.bool, device=device)
    valid = (indices >= 0) & (indices < slots)
    return torch.where(valid, indices, 0).long(), valid


def _write_rows(state, slots, valid, new):
    """state[slots[i]] = new[i] for the real rows, without a host read of ``valid``.

    Padding rows write the same row with the same value as the first real row (or, when there is
    none, row slots[0] with its own old value), so every row of the write is deterministic."""
    first = torch.argmax(valid.to(torch.int32)).reshape(1)             # the first real row, else 0
    first_slot = slots.index_select(0, first)
    new = new.to(state.dtype)
    row_shape = (-1,) + (1,) * (new.ndim - 1)
    kept = torch.where(valid.index_select(0, first).view(row_shape), new.index_select(0, first),
                       state.index_select(0, first_slot))
    target = torch.where(valid, slots, first_slot)
    value = torch.where(valid.view(row_shape), new, kept)
    state.index_copy_(0, target, value)


def rms_norm_reference(args):
    """(Gated) RMSNorm on checked arguments (serving/validation.RmsNormArgs): the rounding to
    x's dtype before the weight, as Hugging Face's modules do, so bf16 results match theirs."""
    dtype = compute_dtype(args.x, args.weight)
    h = args.x.to(dtype)
    if args.gate is not None:
        h = h * F.silu(args.gate.to(dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + args.eps)
    groups = args.weight.shape[0]
    h = h.to(args.x.dtype).to(dtype).reshape(-1, groups, h.shape[-1])
    return (args.weight.to(dtype) * h).to(args.out_dtype).reshape(args.shape)

