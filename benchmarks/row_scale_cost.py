"""What a power-of-two fp16 scale per row costs in a state walk, against one per tile (GPU).

The backward's margins need its walks' operands and stored states in fp16 with a scale
(docs/design.md, Limits: "The backward's margin"). A scale per tile was built and took the walks
from 131 to 382 us: its maximum crosses the block's warps. In the float64 replay a scale per row
gives the same margins; this times the forward state walk (chunk_states_walk.py without packed
sequences or an initial state) in three forms on the same inputs:

  bf16     the package's rounding: weighted b, x and the stored states in bf16
  fp16row  x scaled per token, weighted b per state index, each stored state per state index;
           each scale the power of two that puts its row's largest |value| under 2^14
  fp16tile the same with one scale per tile
  fp16rowx fp16row with x's scale per tile: no per-token vector has to become a per-column one

    python benchmarks/row_scale_cost.py [--shapes B,T,G,H,N,P ...]

It prints the median us of each form (L2 flushed), the ratio to bf16, and each form's largest
relative error of the stored states against a float64 walk of the same inputs.
"""
import argparse

import cuda.tile as ct
import torch

from tilegym_mamba2.bench.forward import measure
from tilegym_mamba2.cutile.launch import launch

CHUNK = 256
ROW, TILE, ROW_X_TILE = 1, 2, 3  # scale forms (0: none, bf16)
SHAPES = ((4, 16384, 1, 8, 128, 64), (2, 8192, 1, 80, 128, 64))


@ct.function
def pow2_scale(largest):
    """The power of two that puts ``largest`` under 2^14 (1 where it is 0)."""
    exponent = ct.floor(ct.log2(ct.maximum(largest, 1e-30)))
    return ct.where(largest > 0.0, ct.exp2(13.0 - exponent), 1.0)


@ct.function
def scaled(values, form: ct.Constant[int]):
    """values * scale and the scale: one per row (a [rows, 1] tile) or one per tile ([1, 1])."""
    magnitude = ct.abs(values)
    if form == ROW or form == ROW_X_TILE:
        scale = pow2_scale(ct.max(magnitude, axis=1, keepdims=True))
    else:
        scale = pow2_scale(ct.max(ct.max(magnitude, axis=1, keepdims=True), axis=0, keepdims=True))
    return values * scale, scale


@ct.kernel(occupancy=4)
def walk_kernel(x, b, dt_bht, decay_cumsum, entry_states, entry_scales, chunk_size: ct.Constant[int],
                head_tile: ct.Constant[int], state_tile: ct.Constant[int], form: ct.Constant[int]):
    batch_head, tile = ct.bid(0), ct.bid(1)
    heads = x.shape[2]
    batch, head = batch_head // heads, batch_head % heads
    group = head // (heads // b.shape[2])
    state_tiles = ct.cdiv(b.shape[3], state_tile)
    p_tile, n_tile = tile // state_tiles, tile % state_tiles
    num_chunks = decay_cumsum.shape[2] // chunk_size
    state_t = ct.zeros((state_tile, head_tile), dtype=ct.float32)
    for chunk in range(num_chunks):
        if form == 0:
            ct.store(entry_states, (batch, head, chunk * state_tiles + n_tile, p_tile),
                     state_t.astype(entry_states.dtype).reshape((1, 1, state_tile, head_tile)))
        else:
            stored, scale = scaled(state_t, form)
            ct.store(entry_states, (batch, head, chunk * state_tiles + n_tile, p_tile),
                     stored.astype(entry_states.dtype).reshape((1, 1, state_tile, head_tile)))
            inverse = ct.broadcast_to(1.0 / scale, (state_tile, 1)).reshape((1, 1, state_tile, 1))
            ct.store(entry_scales, (batch, head, chunk * state_tiles + n_tile, p_tile), inverse)
        x_tile = ct.load(x, (batch, chunk, head, p_tile), (1, chunk_size, 1, head_tile),
                         padding_mode=ct.PaddingMode.ZERO, latency=6).reshape((chunk_size, head_tile))
        b_t = ct.load(b, (batch, n_tile, group, chunk), (1, state_tile, 1, chunk_size), order=(0, 3, 2, 1),
                      padding_mode=ct.PaddingMode.ZERO, latency=6).reshape((state_tile, chunk_size))
        g = ct.load(decay_cumsum, (batch, head, chunk), (1, 1, chunk_size), latency=6).reshape((chunk_size,))
        dt_tile = ct.load(dt_bht, (batch, head, chunk), (1, 1, chunk_size), latency=6).reshape((chunk_size,))
        keep = ct.exp2(ct.extract(g, (chunk_size - 1,), (1,))).reshape((1, 1))
        weight = dt_tile * ct.exp2(ct.extract(g, (chunk_size - 1,), (1,)) - g)
        if form == 0:
            weighted_b = (b_t.astype(ct.float32) * weight[None, :]).astype(x.dtype)
            update = ct.mma(weighted_b, x_tile, ct.zeros((state_tile, head_tile), dtype=ct.float32))
        else:
            # x's token scale moves into the weights (a token is the mma's inner index), then the
            # weighted b's state-index scale comes out of the product's rows: both exact.
            x_scaled, x_scale = scaled(x_tile.astype(ct.float32), TILE if form == ROW_X_TILE else form)
            x_scale_row = ct.broadcast_to(x_scale, (chunk_size, 1)).reshape((chunk_size,))
            weighted, b_scale = scaled(b_t.astype(ct.float32) * (weight / x_scale_row)[None, :], form)
            update = ct.mma(weighted.astype(ct.float16), x_scaled.astype(ct.float16),
                            ct.zeros((state_tile, head_tile), dtype=ct.float32)) / b_scale
        state_t = state_t * keep + update


def walk(form, x, b, dt_bht, decay_cumsum):
    batch, tokens, heads, head_size = x.shape
    state_size, chunks = b.shape[3], tokens // CHUNK
    dtype = torch.bfloat16 if form == 0 else torch.float16
    states = torch.empty(batch, heads, chunks * state_size, head_size, dtype=dtype, device=x.device)
    tile = 64
    scales = torch.ones(batch, heads, chunks * state_size, head_size // tile, dtype=torch.float32, device=x.device)
    grid = (batch * heads, (head_size // tile) * (state_size // tile))
    launch(grid, walk_kernel, (x, b, dt_bht, decay_cumsum, states, scales, CHUNK, tile, tile, form))
    return states, scales


def exact_walk(x, b, dt_bht, decay_cumsum):
    """Float64 entry states [batch, heads, chunks * state, head] of the same bf16 inputs."""
    batch, tokens, heads, head_size = x.shape
    chunks = tokens // CHUNK
    xs = x.double().view(batch, chunks, CHUNK, heads, head_size)
    bs = b.double().repeat_interleave(heads // b.shape[2], dim=2).view(batch, chunks, CHUNK, heads, -1)
    g = decay_cumsum.double().view(batch, heads, chunks, CHUNK)
    weight = dt_bht.double().view(batch, heads, chunks, CHUNK) * torch.exp2(g[..., -1:] - g)
    state = torch.zeros(batch, heads, b.shape[3], head_size, dtype=torch.float64, device=x.device)
    entries = []
    for chunk in range(chunks):
        entries.append(state)
        weighted = bs[:, chunk] * weight[:, :, chunk].transpose(1, 2)[..., None]
        state = state * torch.exp2(g[:, :, chunk, -1])[..., None, None] + torch.einsum(
            "bthn,bthp->bhnp", weighted, xs[:, chunk])
    return torch.cat(entries, dim=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES])
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("row_scale_cost.py times kernels on a GPU; this machine has none")
    for text in arguments.shapes:
        batch, tokens, groups, heads, state_size, head_size = map(int, text.split(","))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(batch, tokens, heads, head_size, device="cuda", generator=gen).bfloat16()
        b = torch.randn(batch, tokens, groups, state_size, device="cuda", generator=gen).bfloat16()
        dt = torch.nn.functional.softplus(torch.randn(batch, heads, tokens, device="cuda", generator=gen) - 2)
        a = -torch.linspace(1, 8, heads, device="cuda")
        decay = torch.cumsum((dt * a[None, :, None]).view(batch, heads, -1, CHUNK), dim=-1).view_as(dt)
        decay = decay * 1.4426950408889634  # base 2, as chunk_cumsum lays it out
        exact = exact_walk(x, b, dt, decay)
        base = None
        for form, name in ((0, "bf16"), (ROW, "fp16row"), (TILE, "fp16tile"), (ROW_X_TILE, "fp16rowx")):
            states, scales = walk(form, x, b, dt, decay)
            stored = states.double() * scales.double().repeat_interleave(64, dim=-1)
            error = ((stored - exact).abs().max() / exact.abs().max()).item()
            us = measure(lambda: walk(form, x, b, dt, decay)) * 1e3
            base = base or us
            print(f"{text:24s} {name:9s} {us:8.1f} us  {us / base:5.2f}x  max error {error:.2e}", flush=True)


if __name__ == "__main__":
    main()
