"""The cutile backend's host code, on the CPU."""
import pytest


def test_compile_failures_inside_the_op_are_explained(monkeypatch):
    """A tileiras failure during the op's first call comes back with the toolchain diagnosis;
    any other error passes through untouched."""
    import tilegym_mamba2.cutile as backend

    failure = RuntimeError("Return code 5: failed to compile Tile IR program")
    monkeypatch.setattr(backend, "check_forward_args", lambda *args, **kw: args[:8])
    monkeypatch.setattr(backend, "run_stages", lambda *args: (_ for _ in ()).throw(failure))
    monkeypatch.setattr(backend, "explain_compile_failure", lambda exc: "CUDA_HOME is CUDA 13.0; fix: ...")
    with pytest.raises(RuntimeError, match="CUDA_HOME is CUDA 13.0") as info:
        backend.mamba2_chunk_forward(*range(7), 64)
    assert info.value.__cause__ is failure

    monkeypatch.setattr(backend, "explain_compile_failure", lambda exc: None)
    with pytest.raises(RuntimeError) as info:
        backend.mamba2_chunk_forward(*range(7), 64)
    assert info.value is failure
