"""Every private name of cuda-tile and tilegym the package relies on, in one place.

setup.cfg pins both below their next minor release; a release inside the pins that moves one of
these names fails here, naming the name and where we use it, before any kernel call meets it.
"""
import importlib

import pytest

# (module, attribute path, where we use it and why)
PRIVATE_NAMES = [
    ("cuda.tile._cext", "launch", "runtime/launch.py: launches on a raw stream handle (host time)"),
    ("cuda.tile._cext", "CallingConvention", "runtime/other_token_class.py: signatures of other token classes"),
    ("cuda.tile._cext", "default_tile_context", "runtime/other_token_class.py: compiling in the background"),
    ("cuda.tile._cext", "get_compute_capability", "runtime/other_token_class.py: the compile key's capability"),
    ("cuda.tile._cext", "get_parameter_constraints_from_pyargs",
     "runtime/other_token_class.py: the signature cuTile's dispatcher computes for a launch"),
    ("cuda.tile._exception", "CompilerExecutionError", "core/toolchain.py: explaining tileiras failures"),
    ("cuda.tile._compile", "_find_compiler_bin", "core/toolchain.py mirrors its search order for tileiras"),
    ("tilegym.backend.dispatcher", "_REGISTRY",
     "core/registry.py: moving a displaced tilegym implementation under another backend name"),
]


@pytest.mark.parametrize("module, name, use", PRIVATE_NAMES, ids=[f"{m}.{n}" for m, n, _ in PRIVATE_NAMES])
def test_private_name_is_where_we_use_it(module, name, use):
    found = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(found, part), (
            f"{module}.{name} is gone from the installed release ({_version(module)}); we use it in {use}. "
            f"Adapt that code to the new release, then move the pin in setup.cfg.")
        found = getattr(found, part)


def test_kernels_compile_through_a_method_we_can_wrap():
    """runtime/other_token_class.py serves a background compile by replacing a kernel's
    ``_compile`` (cuTile's per-kernel compile entry: (signature, context, compute_capability))."""
    import cuda.tile as ct

    @ct.kernel
    def probe(x):
        pass

    compile_method = getattr(type(probe), "_compile", None)
    assert callable(compile_method), (
        f"cuda.tile's kernel type no longer has _compile ({_version('cuda.tile')}); "
        "runtime/other_token_class.py's background compiles wrap it")
    probe._compile = compile_method  # an instance attribute shadows it, as the hook sets it
    assert probe._compile is compile_method


def test_dispatcher_registry_is_a_table_of_backends():
    from tilegym.backend import dispatcher
    assert isinstance(dispatcher._REGISTRY, dict), "tilegym's dispatcher table is no longer a dict"
    assert all(isinstance(slots, dict) for slots in dispatcher._REGISTRY.values()), \
        "tilegym's dispatcher table no longer maps op -> {backend: implementation}"


def _version(module):
    from importlib.metadata import version
    dist = "cuda-tile" if module.startswith("cuda") else "tilegym"
    return f"{dist} {version(dist)}"
