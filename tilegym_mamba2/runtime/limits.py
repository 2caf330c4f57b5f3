"""What each backend takes, as data (core/validation.py's Limits): the cuTile kernels' dtypes, tile
sizes and device rule, and the PyTorch references' (any size, any device, float64 too)."""
import functools

import torch

from ..core.constants import INPUT_DTYPES, MAX_STATE, REFERENCE_INPUT_DTYPES, SPLIT_STATE, TILE_DIMS
from ..core.validation import Limits


def check_cuda_device(device: torch.device) -> None:
    """The cuTile kernels' device rule: CUDA, compute capability 8.0 or newer."""
    if device.type != "cuda":
        raise ValueError(f"the cutile backend needs CUDA tensors, got tensors on {device} (tilegym.ops runs "
                         f"cutile for a backend it has no implementation of, a misspelt name included); "
                         "move them with .cuda() or call with backend=\"pytorch\"")
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if major < 8:
        raise ValueError(f"the cutile backend needs a GPU of compute capability 8.0 or newer, "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# The decode step keeps a [head_size rows, state_size] tile in registers: at most MAX_STATE.
CUTILE = Limits(name="cutile", input_dtypes=INPUT_DTYPES, head_sizes=TILE_DIMS, state_sizes=TILE_DIMS,
                split_state_sizes=(SPLIT_STATE,), serving_max_state=MAX_STATE,
                # looked up at each call, so that a test can stand a CPU in for a GPU
                check_device=lambda device: check_cuda_device(device))
PYTORCH = Limits(name="pytorch", input_dtypes=REFERENCE_INPUT_DTYPES, reads_host_indices=True)
