"""Fixtures of the Hugging Face tests."""
import pytest

pytest.importorskip("transformers")

from tilegym_mamba2.transformers import revert_tilegym_kernel_to_mamba2  # noqa: E402


@pytest.fixture(autouse=True)
def unpatched_classes():
    """Every test starts and ends with transformers' mixer classes as shipped."""
    revert_tilegym_kernel_to_mamba2()
    yield
    revert_tilegym_kernel_to_mamba2()
