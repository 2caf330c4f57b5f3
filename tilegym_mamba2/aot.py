"""Ahead-of-time compilation of every kernel, on a machine with or without a GPU.

The host code runs on CPU placeholder tensors while launches are recorded, so exactly the
kernels and compile-time constants of a real call are compiled (with tileiras) for a target.
"""
import inspect
import io
import time

import cuda.tile as ct
import torch
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                   ScalarConstraint, export_kernel)

from .backends.cutile import KERNELS
from .ssd.backward import chunk_backward, layer_backward
from .serving.validation import (check_conv_args, check_conv_update_args, check_rms_norm_args,
                                     check_state_update_args)
from .core.constants import KERNEL_CHUNK
from .core.validation import ScanCombinedArgs
from .runtime.limits import PYTORCH as PYTORCH_LIMITS
from .ssd.end_state import end_state, end_state_grads
from .ssd.forward import run_stages
from .runtime.launch import recording_launches
from .ssd.layer import run_layer
from .serving.causal_conv1d import run_conv
from .serving.causal_conv1d_update import run_conv_update
from .serving.rms_norm import run_rms_norm
from .serving.selective_state_update import run_state_update
from .runtime.tuning import CHAINED_SEGMENTS, chained_config, choose_config

_DTYPES = {torch.bfloat16: ct.bfloat16, torch.float16: ct.float16, torch.float32: ct.float32,
           torch.int32: ct.int32, torch.int64: ct.int64}


def compile_kernels(target="sm_90", *, batch=2, tokens=1000, groups=1, heads=8, head_size=64,
                    state_size=128, chunk_size=128, dtype=torch.bfloat16, with_init_state=True, chained=False):
    """Compiles every kernel one forward call of this shape launches, for ``target``
    (e.g. "sm_90"); with ``chained``, the one-launch path's kernel (tuning.chained_config).
    Returns [(kernel name, cubin size in bytes, seconds)]."""
    def empty(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt)

    x = empty(batch, tokens, heads, head_size)
    b, c = empty(batch, tokens, groups, state_size), empty(batch, tokens, groups, state_size)
    dt = empty(batch, tokens, heads)
    a, d = empty(heads, dt=torch.float32), empty(heads, dt=torch.float32)
    init = empty(batch, heads, head_size, state_size, dt=torch.float32) if with_init_state else None
    config = choose_config(batch, tokens, groups, heads, head_size, state_size, chunk_size)
    if chained:
        config = chained_config(config, CHAINED_SEGMENTS[-1])
    with recording_launches() as launches:
        run_stages(x, a, b, c, d, dt, init, chunk_size, config)
    return _export(launches, target)


def compile_layer_kernels(target="sm_90", *, sequences=3, tokens=1000, groups=1, heads=8, head_size=64,
                          state_size=128, chunk_size=128, dtype=torch.bfloat16, per_sequence_init=False):
    """Like ``compile_kernels`` for the layer op with every option on: dt_bias, softplus,
    dt_limit, D per channel, z, ``sequences`` packed sequences (cu_seqlens) with their varlen
    states, and initial states per row or (``per_sequence_init``) per sequence."""
    def empty(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt)

    x, z = empty(1, tokens, heads, head_size), empty(1, tokens, heads, head_size)
    b, c = empty(1, tokens, groups, state_size), empty(1, tokens, groups, state_size)
    dt = empty(1, tokens, heads)
    a, dt_bias = empty(heads, dt=torch.float32), empty(heads, dt=torch.float32)
    d = empty(heads, head_size, dt=torch.float32)
    cu_seqlens = torch.linspace(0, tokens, sequences + 1).round().to(torch.int32)
    init = empty(sequences if per_sequence_init else 1, heads, head_size, state_size, dt=torch.float32)
    config = choose_config(1, tokens, groups, heads, head_size, state_size, chunk_size)
    with recording_launches() as launches:
        run_layer(ScanCombinedArgs(x=x, dt=dt, A=a, B=b, C=c, chunk_size=chunk_size, D=d, z=z, dt_bias=dt_bias,
                                   initial_states=init, cu_seqlens=cu_seqlens, dt_softplus=True, dt_limit=(0.001, 0.1),
                                   return_final_states=True, return_varlen_states=True), config=config)
    return _export(launches, target)


def compile_backward_kernels(target="sm_90", *, sequences=3, tokens=1000, groups=1, heads=8, head_size=64,
                             state_size=128, dtype=torch.bfloat16, layer=None):
    """The kernels of a backward call: mamba2_chunk_backward with an initial state (``layer``
    None), or the layer op's backward with every option on and ``sequences`` packed sequences,
    either with row initial states ("packed": the chunk-local decay gradient) or with initial
    states per sequence and gradients of their varlen states ("sequence_states": suffix sums)."""
    def empty(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt)

    rows = 2 if layer is None else 1
    x, dout = empty(rows, tokens, heads, head_size), empty(rows, tokens, heads, head_size)
    b, c = empty(rows, tokens, groups, state_size), empty(rows, tokens, groups, state_size)
    dt = empty(rows, tokens, heads, dt=torch.float32)
    a, d = empty(heads, dt=torch.float32), empty(heads, dt=torch.float32)
    state = (heads, head_size, state_size)
    with recording_launches() as launches:
        if layer is None:
            init, dfinal = empty(rows, *state, dt=torch.float32), empty(rows, *state, dt=torch.float32)
            chunk_backward(KERNELS, x, a, b, c, d, dt, init, dout, dfinal)
        else:
            cu_seqlens = torch.linspace(0, tokens, sequences + 1).round().to(torch.int32)
            per_sequence = layer == "sequence_states"
            init = empty(sequences if per_sequence else 1, *state, dt=torch.float32)
            saved = ScanCombinedArgs(x=x, dt=dt, A=a, B=b, C=c, chunk_size=KERNEL_CHUNK,
                                     D=empty(heads, head_size, dt=torch.float32), z=empty(*x.shape), dt_bias=a,
                                     initial_states=init, cu_seqlens=cu_seqlens, dt_softplus=True,
                                     return_final_states=True, return_varlen_states=per_sequence)
            layer_backward(KERNELS, saved, dout, empty(1, *state, dt=torch.float32),
                           empty(sequences, *state, dt=torch.float32) if per_sequence else None)
    # Each distinct (kernel, compile-time constants) once: the four scans repeat some.
    unique = {}
    for kernel, args in launches:
        signature = (kernel, tuple((a.dtype, a.ndim) if isinstance(a, torch.Tensor) else a for a in args))
        unique.setdefault(signature, (kernel, args))
    return _export(list(unique.values()), target)


def compile_end_state_kernels(target="sm_90", *, batch=1, tokens=1000, groups=1, heads=8, head_size=64,
                              state_size=128, dtype=torch.bfloat16):
    """The kernels of a context-parallel rank's summary (ssd/end_state.py), forward and backward."""
    x = torch.zeros(batch, tokens, heads, head_size, dtype=dtype)
    b = torch.zeros(batch, tokens, groups, state_size, dtype=dtype)
    per_token = torch.zeros(batch, tokens, heads)
    starts = torch.zeros(batch, dtype=torch.int32)
    with recording_launches() as launches:
        end_state(x, b, per_token, per_token)
        end_state_grads(x, b, per_token.transpose(1, 2), per_token.transpose(1, 2),
                        torch.zeros(batch, heads, head_size, state_size), starts)
    return _export(launches, target)


def _export(launches, target):
    results = []
    for kernel, args in launches:
        start = time.perf_counter()
        cubin = io.BytesIO()
        export_kernel(kernel, [kernel_signature(kernel, args)], cubin, gpu_code=target,
                      output_format="cubin")
        results.append((kernel._pyfunc.__name__, len(cubin.getvalue()), time.perf_counter() - start))
    return results


def kernel_signature(kernel, args) -> KernelSignature:
    """The signature a JIT launch with these arguments would compile, without needing a GPU."""
    params = inspect.signature(kernel._pyfunc).parameters.values()
    constraints = []
    for param, arg in zip(params, args):
        if isinstance(arg, torch.Tensor):
            constraints.append(ArrayConstraint(
                _DTYPES[arg.dtype], arg.ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                alias_groups=(), may_alias_internally=False,
                stride_constant=(None,) * (arg.ndim - 1) + (1,)))
        elif param.annotation is inspect.Parameter.empty and isinstance(arg, int) and not isinstance(arg, bool):
            constraints.append(ScalarConstraint(ct.int32))
        else:
            constraints.append(arg)  # a ct.Constant parameter: its value
    return KernelSignature(constraints, CallingConvention.cutile_python_v1()).with_mangled_symbol(
        kernel._pyfunc.__name__)


def compile_state_update_kernels(target="sm_90", *, batch=4, slots=6, heads=8, head_size=64, state_size=128,
                                 groups=1, dtype=torch.bfloat16, state_dtype=torch.float32, tied=True,
                                 with_d=True, with_z=True, with_bias=True, softplus=True, with_indices=True,
                                 without_heads=False, index_dtype=torch.int32):
    """Compiles the selective_state_update kernel of one call: ``tied`` passes dt, A, D and dt_bias
    expanded from per-head values (HF's Mamba-2 call), otherwise one value per channel (A per
    element); ``without_heads`` is mamba_ssm's 3-D form."""
    def empty(*shape, dt=torch.float32):
        return torch.empty(*shape, dtype=dt)

    if without_heads:
        heads, groups = 1, 1
    if tied:
        dt = empty(batch, heads, 1, dt=dtype).expand(batch, heads, head_size)
        A = empty(heads, 1, 1).expand(heads, head_size, state_size)
        D, dt_bias = empty(heads, 1).expand(heads, head_size), empty(heads, 1).expand(heads, head_size)
    else:
        dt, A = empty(batch, heads, head_size, dt=dtype), empty(heads, head_size, state_size)
        D, dt_bias = empty(heads, head_size), empty(heads, head_size)
    kw = dict(state=empty(slots if with_indices else batch, heads, head_size, state_size, dt=state_dtype),
              x=empty(batch, heads, head_size, dt=dtype), dt=dt, A=A, B=empty(batch, groups, state_size, dt=dtype),
              C=empty(batch, groups, state_size, dt=dtype), D=D if with_d else None,
              z=empty(batch, heads, head_size, dt=dtype) if with_z else None, dt_bias=dt_bias if with_bias else None,
              dt_softplus=softplus,
              state_batch_indices=torch.arange(batch, dtype=index_dtype) if with_indices else None)
    if without_heads:
        kw = {k: (v.squeeze(1) if k in ("state", "x", "dt", "z", "B", "C") else v.squeeze(0) if k in (
            "A", "D", "dt_bias") else v) if isinstance(v, torch.Tensor) and k != "state_batch_indices" else v
            for k, v in kw.items()}
    args = check_state_update_args(**kw, limits=PYTORCH_LIMITS)
    with recording_launches() as launches:
        run_state_update(args)
    return _export(launches, target)


def compile_conv_kernels(target="sm_90", *, batch=2, dim=320, tokens=300, width=4, dtype=torch.bfloat16,
                         channel_last=True, with_bias=True, with_seq_idx=False, with_init=False, with_final=False,
                         activation="silu", index_dtype=torch.int32):
    """Compiles the causal_conv1d_fn kernel of one call (x channel-last as HF's mixer passes it,
    or channel-first)."""
    x = torch.empty(batch, tokens, dim, dtype=dtype).transpose(1, 2) if channel_last else \
        torch.empty(batch, dim, tokens, dtype=dtype)
    args = check_conv_args(
        x, torch.empty(dim, width, dtype=dtype), torch.empty(dim, dtype=dtype) if with_bias else None,
        torch.zeros(batch, tokens, dtype=index_dtype) if with_seq_idx else None,
        torch.empty(batch, dim, width - 1, dtype=dtype) if with_init else None, with_final, None, activation,
        limits=PYTORCH_LIMITS)
    with recording_launches() as launches:
        run_conv(args)
    return _export(launches, target)


def compile_conv_update_kernels(target="sm_90", *, batch=4, slots=6, dim=320, tokens=1, width=4, state_len=None,
                                dtype=torch.bfloat16, with_bias=True, circular=False, with_indices=True,
                                activation="silu", index_dtype=torch.int32):
    """Compiles the causal_conv1d_update kernel of one call (by default a decode step: one token,
    state_len width - 1, continuous batching indices)."""
    state_len = width - 1 if state_len is None else state_len
    args = check_conv_update_args(
        torch.empty(batch, dim, tokens, dtype=dtype),
        torch.empty(slots if with_indices else batch, dim, state_len, dtype=dtype),
        torch.empty(dim, width, dtype=dtype), torch.empty(dim, dtype=dtype) if with_bias else None, activation,
        torch.zeros(batch, dtype=index_dtype) if circular else None,
        torch.arange(batch, dtype=index_dtype) if with_indices else None, limits=PYTORCH_LIMITS)
    with recording_launches() as launches:
        run_conv_update(args)
    return _export(launches, target)


def compile_rms_norm_kernels(target="sm_90", *, rows=3, width=5120, dtype=torch.bfloat16, gated=True,
                             group_size=None, weight_dtype=None):
    """Compiles the rms_norm kernel of one call (by default a Mamba-2 mixer's gated norm)."""
    x = torch.empty(rows, width, dtype=dtype)
    args = check_rms_norm_args(x, torch.empty(width, dtype=weight_dtype or dtype),
                               torch.empty(rows, width, dtype=dtype) if gated else None, 1e-5, group_size,
                               limits=PYTORCH_LIMITS)
    with recording_launches() as launches:
        run_rms_norm(args)
    return _export(launches, target)


def compile_serving_kernels(target="sm_90"):
    """The serving ops' kernels as a Mamba-2 model calls them: selective_state_update and
    causal_conv1d_update of a decode step (HF's expanded per-head dt, A, D, dt_bias; continuous
    batching indices), causal_conv1d_fn of a prefill (channel-last, silu) and with packed
    sequences, the mixer's gated RMSNorm and the block's RMSNorm.
    -> [(kernel name, cubin size in bytes, seconds)]."""
    return (compile_state_update_kernels(target) + compile_conv_update_kernels(target)
            + compile_conv_kernels(target) + compile_conv_kernels(target, with_seq_idx=True)
            + compile_rms_norm_kernels(target) + compile_rms_norm_kernels(target, width=2560, gated=False))
