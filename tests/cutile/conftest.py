"""Fixtures of the cuTile tests."""
import pytest


@pytest.fixture(scope="module")
def fresh_compile_cache(tmp_path_factory):
    """Points cuTile's disk cache at an empty directory for this module, the way
    ct.compiler_timeout changes the context's config."""
    try:
        from cuda.tile._cext import default_tile_context
        config = default_tile_context.config
        previous = config.cache_dir
    except (ImportError, AttributeError):  # another cuTile layout: keep its cache
        yield
        return
    config.cache_dir = str(tmp_path_factory.mktemp("cutile-cache"))
    try:
        yield
    finally:
        config.cache_dir = previous
