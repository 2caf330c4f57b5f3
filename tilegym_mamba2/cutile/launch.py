"""The one place kernels are launched, so that ahead-of-time compilation can record the
exact launches the host code makes (kernel and arguments) instead of running them."""
import contextlib

import cuda.tile as ct
import torch

_recording: list | None = None


def launch(grid, kernel, args):
    if _recording is not None:
        _recording.append((kernel, tuple(args)))
        return
    ct.launch(torch.cuda.current_stream(), grid, kernel, tuple(args))


@contextlib.contextmanager
def recording_launches():
    """Collects (kernel, args) for every launch inside the block; nothing runs."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous
