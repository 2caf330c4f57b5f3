"""Every number the contracts, the kernels and the references share, defined once.

Each is a fact about the math, a contract, or a kernel's shape; the kernels' tuned choices
(tile sizes per shape) stay in runtime/tuning.py, where they are measured.
"""
import math

import torch

# --- the contracts ----------------------------------------------------------------------------
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The pytorch backend also takes float64 (and then computes in it), so that
# torch.autograd.gradcheck can run against it on a CPU.
REFERENCE_INPUT_DTYPES = INPUT_DTYPES + (torch.float64,)
CHUNK_SIZES = (16, 32, 64, 128, 256)
NO_LIMIT = (0.0, float("inf"))  # the default dt_limit: no clamp

# --- the math -----------------------------------------------------------------------------------
# Decay sums are kept in base 2 (kernels take exp2, a single instruction): exp(v) = exp2(v * LOG2E).
LOG2E = math.log2(math.e)
# The log decay a * dt is kept at or above this: exp(-1000) is 0 in fp32 and float64 alike, so the
# decay past it is the total one the recurrence gives, and a = -inf (or an a * dt past fp32's
# range) no longer makes the chunked sums' differences inf - inf = NaN.
LOG_DECAY_FLOOR = -1000.0
# Above it softplus(v) == v in fp32; mamba_ssm and torch's softplus pass such values through.
SOFTPLUS_THRESHOLD = 20.0

# --- the cuTile kernels' shapes -----------------------------------------------------------------
# cuTile tiles have power-of-two shapes and tensor-core matmuls need at least 16 along each side.
TILE_DIMS = (16, 32, 64, 128, 256)
# The widest state a kernel carries; the plain op runs state_size SPLIT_STATE (tilegym's own grid
# has it) as two halves of MAX_STATE: the recurrence is separate per state column.
MAX_STATE = 256
SPLIT_STATE = 2 * MAX_STATE
# The kernels' own chunk length, whatever chunk_size the call names (the result does not depend
# on it): 64-token chunks ran compute_out 2x faster than 128 on the H200 (docs/design.md).
KERNEL_CHUNK = 64
# Chunks a state-pass segment walks by default (runtime/tuning.py tunes per shape).
SEGMENT_CHUNKS = 16
# A varlen state walks up to a segment of chunks: the cap keeps that walk short.
VARLEN_MAX_SEGMENT_CHUNKS = 16
