import os
import tempfile

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available); run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """Tuned choices go to a cache of the test run's own, not the user's."""
    os.environ["TILEGYM_MAMBA2_CACHE_DIR"] = tempfile.mkdtemp(prefix="tilegym-mamba2-tuning-")
