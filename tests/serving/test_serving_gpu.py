"""The serving kernels against the float64 pytorch backend, on a GPU (skipped elsewhere).

Every output buffer starts as NaN (poisoned_outputs), so an unwritten element fails; each test
draws fresh random inputs (the seed is in the failure message). The reference runs on float64
copies of the same (rounded) inputs and of the state before the call."""
import os

import pytest
import torch

import tilegym_mamba2
from tilegym_mamba2.runtime.launch import poisoned_outputs

from gpu_checks import fresh_seed, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

# ‖y − ref‖ / ‖ref‖ for outputs in each dtype (one rounding of a short fp32 computation).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def as64(kw):
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else
            (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


# ---------------------------------------------------------------- selective_state_update

def state_update_inputs(batch, heads, head_size, state_size, groups, dtype, state_dtype, seed, *, tied=True,
                        slots=None, options=("D", "z", "dt_bias")):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g, device="cuda") * scale + shift

    slots = batch if slots is None else slots
    if tied:   # HF's Mamba2Mixer decode call: per-head values expanded with stride 0
        dt = r(batch, heads, scale=0.5, shift=-1.0).to(dtype)[:, :, None].expand(batch, heads, head_size)
        A = -torch.exp(r(heads, scale=0.5))[:, None, None].expand(heads, head_size, state_size)
        D = r(heads)[:, None].expand(heads, head_size)
        dt_bias = r(heads, scale=0.5)[:, None].expand(heads, head_size)
    else:
        dt = r(batch, heads, head_size, scale=0.5, shift=-1.0).to(dtype)
        A = -torch.exp(r(heads, head_size, state_size, scale=0.5))
        D, dt_bias = r(heads, head_size), r(heads, head_size, scale=0.5)
    return dict(state=r(slots, heads, head_size, state_size).to(state_dtype), x=r(batch, heads, head_size).to(dtype),
                dt=dt, A=A, B=r(batch, groups, state_size).to(dtype), C=r(batch, groups, state_size).to(dtype),
                D=D if "D" in options else None, z=r(batch, heads, head_size).to(dtype) if "z" in options else None,
                dt_bias=dt_bias if "dt_bias" in options else None, dt_softplus="dt_bias" in options)


def check_state_update(kw, seed, indices=None):
    ref = as64(kw)
    state = kw["state"]
    before = state.clone()
    with poisoned_outputs():
        out = tilegym_mamba2.selective_state_update(**kw, state_batch_indices=indices)
    ref_out = tilegym_mamba2.selective_state_update(**ref, state_batch_indices=indices, backend="pytorch")
    assert out.dtype == kw["x"].dtype and out.shape == kw["x"].shape
    assert rel_err(out, ref_out) < TOLERANCE[kw["x"].dtype], f"out, seed={seed}"
    assert rel_err(state, ref["state"]) < TOLERANCE[state.dtype], f"state, seed={seed}"
    return out, before


STATE_CASES = [
    # batch, heads, head_size, state_size, groups, dtype, state dtype
    (1, 80, 64, 128, 1, torch.bfloat16, torch.float32),        # Mamba2-2.7B decode, batch 1
    (8, 80, 64, 128, 1, torch.bfloat16, torch.float32),
    (256, 80, 64, 128, 1, torch.bfloat16, torch.float32),      # batch 256: the 4K-element tile
    (4, 24, 64, 128, 8, torch.float16, torch.float32),
    (3, 8, 64, 64, 2, torch.float32, torch.float32),
    (2, 8, 128, 16, 1, torch.bfloat16, torch.bfloat16),
    (2, 4, 32, 256, 1, torch.bfloat16, torch.float32),
    (5, 6, 50, 100, 3, torch.float32, torch.float32),          # sizes that are not powers of two
]


@pytest.mark.parametrize("batch,heads,head_size,state_size,groups,dtype,state_dtype", STATE_CASES)
@pytest.mark.parametrize("tied", [True, False], ids=["hf_expanded", "per_channel"])
def test_state_update_matches_reference(batch, heads, head_size, state_size, groups, dtype, state_dtype, tied):
    seed = fresh_seed()
    kw = state_update_inputs(batch, heads, head_size, state_size, groups, dtype, state_dtype, seed, tied=tied)
    check_state_update(kw, seed)


@pytest.mark.parametrize("options", [(), ("z",), ("D",), ("dt_bias",), ("D", "dt_bias")])
def test_state_update_options(options):
    seed = fresh_seed()
    kw = state_update_inputs(4, 16, 64, 128, 2, torch.bfloat16, torch.float32, seed, options=options)
    if "dt_bias" not in options:
        kw["dt"] = kw["dt"].abs()  # no softplus: dt must be positive already
    check_state_update(kw, seed)


def test_state_update_without_heads():
    """mamba_ssm's 3-D form (Mamba-1): A per element."""
    seed = fresh_seed()
    kw = state_update_inputs(4, 1, 96, 16, 1, torch.float32, torch.float32, seed, tied=False)
    flat = {k: (v.squeeze(1) if k in ("state", "x", "dt", "z", "B", "C") else v.squeeze(0))
            if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out, _ = check_state_update(flat, seed)
    assert out.shape == (4, 96)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_state_update_continuous_batching(index_dtype):
    """Rows use scattered state slots; padding rows (-1) give zeros and leave every other slot
    bit-identical."""
    seed = fresh_seed()
    batch, slots = 6, 11
    kw = state_update_inputs(batch, 16, 64, 128, 1, torch.bfloat16, torch.float32, seed, slots=slots)
    # -1 and indices past the last slot (11, 1000: device values the host checks cannot see) are
    # padding rows: zeros out, nothing read or written out of bounds.
    indices = torch.tensor([7, -1, 0, 10, 11 if index_dtype == torch.int32 else 1000, 3], dtype=index_dtype,
                           device="cuda")
    out, before = check_state_update(kw, seed, indices)
    assert torch.all(out[1] == 0) and torch.all(out[4] == 0)
    used = {7, 0, 10, 3}
    for slot in range(slots):
        changed = not torch.equal(kw["state"][slot], before[slot])
        assert changed == (slot in used), f"slot {slot}: changed={changed}, seed={seed}"


def test_state_update_is_in_place_on_a_strided_state():
    """The state may be a view (a layer's slice of a cache tensor): written where it lives."""
    seed = fresh_seed()
    kw = state_update_inputs(3, 8, 64, 64, 1, torch.bfloat16, torch.float32, seed)
    cache = torch.randn(3, 8, 2, 64, 64, device="cuda")
    kw["state"] = cache[:, :, 1]
    assert not kw["state"].is_contiguous()
    other = cache[:, :, 0].clone()
    check_state_update(kw, seed)
    assert torch.equal(cache[:, :, 0], other)


def test_back_to_back_steps_read_what_the_kernel_before_wrote():
    """Small grids are launched as programmatic dependents: their blocks may be scheduled before
    the kernel ahead has finished. Each step's x is written by a long matmul launched right
    before it (into a NaN-filled buffer, its last rows last), and each step's state by the step
    before; twelve steps against the reference's chain."""
    from tilegym_mamba2.serving import selective_state_update as ssu
    seed = fresh_seed()
    batch, heads, head_size = 1, 80, 64
    kw = state_update_inputs(batch, heads, head_size, 128, 1, torch.float32, torch.float32, seed)
    assert batch * heads * (head_size // ssu.tiles_for(head_size, 128)[0]) <= ssu.DEPENDENT_LAUNCH_MAX_BLOCKS
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    left = torch.randn(2048, 2048, generator=g, device="cuda") / 2048 ** 0.5
    right = [torch.randn(2048, heads * head_size, generator=g, device="cuda") for _ in range(12)]
    product = torch.empty(2048, heads * head_size, device="cuda")
    ref = as64(kw)
    for step, weights in enumerate(right):
        product.fill_(float("nan"))
        torch.mm(left, weights, out=product)
        kw["x"] = product[-batch:].view(batch, heads, head_size)
        out = tilegym_mamba2.selective_state_update(**kw)
        ref["x"] = kw["x"].double()
        ref_out = tilegym_mamba2.selective_state_update(**ref, backend="pytorch")
        assert rel_err(out, ref_out) < TOLERANCE[torch.float32], f"step {step} out, seed={seed}"
    assert rel_err(kw["state"], ref["state"]) < TOLERANCE[torch.float32], f"state, seed={seed}"


# ---------------------------------------------------------------- causal_conv1d_fn

def conv_inputs(batch, dim, tokens, width, dtype, seed, channel_last=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, tokens, dim, generator=g, device="cuda").to(dtype)
    x = x.transpose(1, 2) if channel_last else x.transpose(1, 2).contiguous()
    return dict(x=x, weight=torch.randn(dim, width, generator=g, device="cuda").to(dtype),
                bias=torch.randn(dim, generator=g, device="cuda").to(dtype))


CONV_CASES = [
    # batch, dim, tokens, width, dtype, channel_last
    (2, 5376, 300, 4, torch.bfloat16, True),     # Mamba2-2.7B's xBC channels
    (1, 5376, 1, 4, torch.bfloat16, True),
    (3, 100, 129, 3, torch.float16, True),
    (2, 64, 1000, 2, torch.float32, False),
    (1, 200, 77, 4, torch.float32, False),
]


@pytest.mark.parametrize("batch,dim,tokens,width,dtype,channel_last", CONV_CASES)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_matches_reference(batch, dim, tokens, width, dtype, channel_last, activation):
    seed = fresh_seed()
    kw = conv_inputs(batch, dim, tokens, width, dtype, seed, channel_last)
    with poisoned_outputs():
        out = tilegym_mamba2.causal_conv1d_fn(**kw, activation=activation)
    ref = tilegym_mamba2.causal_conv1d_fn(**as64(kw), activation=activation, backend="pytorch")
    assert out.dtype == dtype and out.shape == kw["x"].shape
    if tokens > 1:
        assert (out.stride(1) == 1) == channel_last, "out keeps x's layout"
    assert rel_err(out, ref) < TOLERANCE[dtype], f"seed={seed}"


@pytest.mark.parametrize("tokens", [1, 2, 500])
@pytest.mark.parametrize("given_buffer", [False, True])
def test_conv_initial_and_final_states(tokens, given_buffer):
    seed = fresh_seed()
    kw = conv_inputs(2, 320, tokens, 4, torch.bfloat16, seed)
    kw["initial_states"] = torch.randn(2, 320, 3, device="cuda").to(torch.bfloat16)
    buffer = torch.full((2, 320, 3), float("nan"), device="cuda", dtype=torch.bfloat16) if given_buffer else None
    with poisoned_outputs():
        out, final = tilegym_mamba2.causal_conv1d_fn(**kw, return_final_states=True, final_states_out=buffer,
                                                     activation="silu")
    ref_out, ref_final = tilegym_mamba2.causal_conv1d_fn(**as64(kw), return_final_states=True, activation="silu",
                                                         backend="pytorch")
    assert rel_err(out, ref_out) < 1e-2, f"seed={seed}"
    assert torch.equal(final.double(), ref_final), f"final states are copies of inputs, seed={seed}"
    if given_buffer:
        assert final is buffer


def test_conv_seq_idx_packed_sequences_and_padding():
    seed = fresh_seed()
    kw = conv_inputs(2, 256, 200, 4, torch.bfloat16, seed)
    lengths = [[1, 2, 60, 137], [100, 64, 30, 6]]  # the second row ends in 6 padding tokens (-1)
    seq_idx = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths], dtype=torch.int32,
                           device="cuda")
    seq_idx[1, -6:] = -1
    with poisoned_outputs():
        out = tilegym_mamba2.causal_conv1d_fn(**kw, seq_idx=seq_idx, activation="silu")
    ref = tilegym_mamba2.causal_conv1d_fn(**as64(kw), seq_idx=seq_idx, activation="silu", backend="pytorch")
    assert rel_err(out, ref) < 1e-2, f"seed={seed}"
    assert torch.all(out[1, :, -6:] == 0)


# ---------------------------------------------------------------- causal_conv1d_update

def conv_update_inputs(batch, dim, tokens, width, state_len, slots, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    return dict(x=r(batch, dim, tokens), conv_state=r(slots, dim, state_len), weight=r(dim, width), bias=r(dim))


def check_conv_update(kw, seed, **options):
    ref = as64(kw)
    before = kw["conv_state"].clone()
    with poisoned_outputs():
        out = tilegym_mamba2.causal_conv1d_update(**kw, **options)
    ref_out = tilegym_mamba2.causal_conv1d_update(**ref, **options, backend="pytorch")
    assert out.shape == kw["x"].shape and out.dtype == kw["x"].dtype
    assert rel_err(out, ref_out) < TOLERANCE[kw["x"].dtype], f"seed={seed}"
    assert torch.equal(kw["conv_state"].double(), ref["conv_state"]), f"the state holds copies of inputs, seed={seed}"
    return out, before


CONV_UPDATE_CASES = [
    # batch, dim, tokens, width, state_len, dtype
    (1, 5376, 1, 4, 3, torch.bfloat16),          # Mamba2-2.7B decode
    (4, 5376, 1, 4, 4, torch.bfloat16),          # HF's cache keeps conv_kernel (= width) entries
    (256, 5376, 1, 4, 3, torch.bfloat16),
    (4, 100, 1, 2, 1, torch.float16),
    (3, 64, 3, 4, 6, torch.float32),             # several tokens, longer state
    (2, 300, 5, 3, 2, torch.bfloat16),           # more tokens than the state holds
]


@pytest.mark.parametrize("batch,dim,tokens,width,state_len,dtype", CONV_UPDATE_CASES)
@pytest.mark.parametrize("circular", [False, True])
def test_conv_update_matches_reference(batch, dim, tokens, width, state_len, dtype, circular):
    seed = fresh_seed()
    kw = conv_update_inputs(batch, dim, tokens, width, state_len, batch, dtype, seed)
    options = dict(activation="silu")
    if circular:
        options["cache_seqlens"] = torch.randint(0, 50, (batch,), dtype=torch.int32, device="cuda")
    check_conv_update(kw, seed, **options)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_conv_update_two_dimensional_x_and_continuous_batching(index_dtype):
    seed = fresh_seed()
    kw = conv_update_inputs(5, 5376, 1, 4, 3, 9, torch.bfloat16, seed)
    kw["x"] = kw["x"][..., 0]
    indices = torch.tensor([8, 0, -1 if index_dtype == torch.int32 else 9, 4, 2], dtype=index_dtype, device="cuda")
    out, before = check_conv_update(kw, seed, activation="silu", conv_state_indices=indices)
    assert out.shape == (5, 5376) and torch.all(out[2] == 0)
    for slot in range(9):
        changed = not torch.equal(kw["conv_state"][slot], before[slot])
        assert changed == (slot in (8, 0, 4, 2)), f"slot {slot}, seed={seed}"


# ---------------------------------------------------------------- a decode step in a CUDA graph

def test_decode_step_captures_in_a_cuda_graph_and_replays():
    """causal_conv1d_update then selective_state_update, as a Mamba-2 mixer's decode step, captured
    once and replayed on new tokens: each replay matches the eager float64 reference of that step,
    and the states carry over between replays."""
    seed = fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, slots, heads, head_size, state_size, groups, width = 4, 6, 8, 64, 128, 1, 4
    intermediate = heads * head_size
    conv_dim = intermediate + 2 * groups * state_size

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    weight, bias = r(conv_dim, width), r(conv_dim)
    A_log, D_param, dt_bias_param = r(heads, dtype=torch.float32), r(heads, dtype=torch.float32), r(heads, dtype=torch.float32)
    conv_state = r(slots, conv_dim, width - 1)
    ssm_state = r(slots, heads, head_size, state_size, dtype=torch.float32)
    indices = torch.tensor([5, 0, -1, 2], dtype=torch.int32, device="cuda")
    # Static input buffers, refilled before each replay.
    xBC_in, dt_in, z_in = r(batch, conv_dim), r(batch, heads), r(batch, heads, head_size)

    def step(backend, conv_state, ssm_state, xBC_in, dt_in, z_in, weight, bias, A_log, D_param, dt_bias_param):
        xBC = tilegym_mamba2.causal_conv1d_update(xBC_in, conv_state, weight, bias, "silu",
                                                  conv_state_indices=indices, backend=backend)
        if backend == "pytorch":  # the kernels pass xBC on in bf16: so does the reference
            xBC = xBC.to(torch.bfloat16).double()
        x, B, C = torch.split(xBC, [intermediate, groups * state_size, groups * state_size], dim=-1)
        A = -torch.exp(A_log)
        return tilegym_mamba2.selective_state_update(
            ssm_state, x.view(batch, heads, head_size), dt_in[:, :, None].expand(-1, -1, head_size),
            A[:, None, None].expand(heads, head_size, state_size), B.view(batch, groups, state_size),
            C.view(batch, groups, state_size), D=D_param[:, None].expand(-1, head_size), z=z_in,
            dt_bias=dt_bias_param[:, None].expand(-1, head_size), dt_softplus=True, state_batch_indices=indices,
            backend=backend)

    params = (weight, bias, A_log, D_param, dt_bias_param)
    ref_conv, ref_ssm = conv_state.double(), ssm_state.double()
    ref_params = tuple(p.double() for p in params)
    # Warm up (compiles the kernels) on a side stream, as torch.cuda.graphs asks, then capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    warm_conv, warm_ssm = conv_state.clone(), ssm_state.clone()
    with torch.cuda.stream(stream):
        step("cutile", warm_conv, warm_ssm, xBC_in, dt_in, z_in, *params)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step("cutile", conv_state, ssm_state, xBC_in, dt_in, z_in, *params)
    # Capturing must not have run the step: the states are still the initial ones.
    assert torch.equal(conv_state.double(), ref_conv) and torch.equal(ssm_state.double(), ref_ssm)
    for replay in range(3):
        xBC_in.copy_(r(batch, conv_dim))
        dt_in.copy_(r(batch, heads))
        z_in.copy_(r(batch, heads, head_size))
        out.fill_(float("nan"))
        graph.replay()
        ref_out = step("pytorch", ref_conv, ref_ssm, xBC_in.double(), dt_in.double(), z_in.double(), *ref_params)
        torch.cuda.synchronize()
        assert rel_err(out, ref_out) < 1e-2, f"replay {replay}, seed={seed}"
        assert rel_err(ssm_state, ref_ssm) < 1e-3, f"replay {replay}, seed={seed}"
        assert torch.equal(conv_state.double(), ref_conv), f"replay {replay}, seed={seed}"
        assert torch.all(out[2] == 0), "the padding row"
