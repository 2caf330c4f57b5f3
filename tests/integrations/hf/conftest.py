"""Fixtures of the Hugging Face tests."""
import types

import pytest

pytest.importorskip("transformers")

import tilegym_mamba2  # noqa: E402
from tilegym_mamba2.transformers import revert_tilegym_kernel_to_mamba2  # noqa: E402

from hf_models import OURS  # noqa: E402  (pytest puts this folder on sys.path)


@pytest.fixture(autouse=True)
def unpatched_classes():
    """Every test starts and ends with transformers' mixer classes as shipped."""
    revert_tilegym_kernel_to_mamba2()
    yield
    revert_tilegym_kernel_to_mamba2()


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of our four functions (and the backend each was asked for)."""
    counts = {name: 0 for name in OURS}
    backends = set()
    real_functions = {name: getattr(tilegym_mamba2, name) for name in OURS}
    for name in OURS:
        real = real_functions[name]

        def spy(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            backends.add(kwargs.get("backend"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(tilegym_mamba2, name, spy)
    yield types.SimpleNamespace(counts=counts, backends=backends, real=real_functions)
