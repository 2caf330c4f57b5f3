import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available); run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def private_tuning_cache(tmp_path_factory):
    """Tuned choices go to a cache of the test session's own, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TILEGYM_MAMBA2_CACHE_DIR", str(tmp_path_factory.mktemp("tuning-cache")))
        yield
