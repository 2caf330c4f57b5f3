"""ops_registry.yaml and the registration of its ops with tilegym's dispatcher.

Whatever touches tilegym's global dispatcher state (or pretends tilegym is absent) runs in
a fresh interpreter, so the situations cannot leak into each other or into other tests.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tilegym_mamba2
from tilegym_mamba2.core.registry import load_registry, resolve

REPO = Path(__file__).resolve().parents[2]
OP = "mamba2_chunk_forward"

# Small CPU inputs and a float64 reference, shared by the subprocess scripts.
PRELUDE = textwrap.dedent("""
    import torch
    from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
    from tilegym_mamba2.ssd.reference.forward import chunked_forward_reference

    spec = Mamba2ProblemSpec(batch_size=2, num_tokens=40, num_groups=2, num_heads=4,
                             state_size=8, head_size=8, chunk_size=16,
                             dtype=torch.float32, device="cpu")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    ref_out, ref_state = chunked_forward_reference(**inputs)

    def check_result(result):
        out, state = result
        assert out.shape == inputs["x"].shape and out.dtype == torch.float32, out
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), ref_state, rtol=1e-4, atol=1e-4)
""")


def run_python(script: str, cwd=REPO, env=None) -> str:
    """Runs ``script`` in a fresh interpreter; fails the test with its output if it fails."""
    res = subprocess.run([sys.executable, "-c", "import sys\n" + script], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"subprocess failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


# ---------------------------------------------------------------- the yaml itself

def test_shipped_registry_parses():
    entries = load_registry()
    assert OP in entries
    entry = entries[OP]
    assert entry.name == OP
    assert set(entry.backends) == {"cutile", "pytorch"}
    assert entry.fallback == "pytorch"
    assert entry.displaces == "tilegym-cutile"
    assert "chunk_size" in entry.contract


def test_every_target_resolves_to_a_callable():
    targets = [t for e in load_registry().values() for t in e.backends.values()]
    assert targets
    for target in targets:
        module, function = target.split(":")
        impl = resolve(target)
        assert callable(impl), target
        assert impl.__module__ == module and impl.__name__ == function, target


def one_op_registry(extra_backend: str, fallback: str) -> str:
    """A registry text with one op, my_op: the pytorch backend, ``extra_backend`` and ``fallback``."""
    return textwrap.dedent(f"""
        ops:
          my_op:
            backends:
              pytorch: tilegym_mamba2.backends.pytorch:mamba2_chunk_forward_pytorch
              {extra_backend}
            fallback: {fallback}
    """)


@pytest.mark.parametrize("target", ["no_colon_here", "a:b:c", 123, None])
def test_bad_target_names_the_entry(target):
    text = one_op_registry(f"cutile: {json.dumps(target)}", "pytorch")
    with pytest.raises(ValueError, match=r"my_op\.backends\.cutile"):
        load_registry(text)


@pytest.mark.parametrize("fallback", ["triton", None])
def test_fallback_not_a_backend_names_the_entry(fallback):
    text = one_op_registry("", json.dumps(fallback))
    with pytest.raises(ValueError, match=r"my_op\.fallback"):
        load_registry(text)


def test_valid_custom_registry_parses():
    text = textwrap.dedent("""
        ops:
          my_op:
            backends: {pytorch: "pkg.mod:fn"}
            fallback: pytorch
    """)
    entry = load_registry(text)["my_op"]
    assert entry.backends == {"pytorch": "pkg.mod:fn"}
    assert entry.displaces is None and entry.contract == ""


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend") as info:
        tilegym_mamba2.mamba2_chunk_forward(None, None, None, None, None, None, backend="nope")
    assert "'nope'" in str(info.value)
    assert "pytorch" in str(info.value) and "cutile" in str(info.value)


# ---------------------------------------------------------------- tilegym integration

def test_tilegym_with_its_own_op():
    """Situation A: tilegym 1.5.1 ships mamba2_chunk_forward; ours takes the "cutile" slot
    and tilegym's stays reachable as "tilegym-cutile"."""
    pytest.importorskip("tilegym")
    run_python(textwrap.dedent("""
        import importlib
        import tilegym
        from tilegym.backend.dispatcher import _REGISTRY
        assert "tilegym_mamba2" not in sys.modules
        theirs_before = _REGISTRY["mamba2_chunk_forward"].get("cutile")
        assert theirs_before is not None, "this tilegym has no mamba2_chunk_forward"
        """) + PRELUDE + textwrap.dedent("""
        import tilegym_mamba2
        from tilegym_mamba2.core.registry import LazyImpl, install, load_registry
        targets = load_registry()["mamba2_chunk_forward"].backends

        def check_slots():
            slots = _REGISTRY["mamba2_chunk_forward"]
            for backend in ("cutile", "pytorch"):
                assert isinstance(slots[backend], LazyImpl), (backend, slots[backend])
                assert slots[backend].target == targets[backend]
            theirs = slots["tilegym-cutile"]
            assert not isinstance(theirs, LazyImpl), theirs
            assert theirs is theirs_before
            assert theirs.__module__.startswith("tilegym.ops.cutile"), theirs.__module__

        check_slots()
        check_result(tilegym.ops.mamba2_chunk_forward(**inputs, backend="pytorch"))

        # Registering again must not move our own implementation into "tilegym-cutile".
        assert install() is True
        importlib.reload(tilegym_mamba2)
        check_slots()
        check_result(tilegym.ops.mamba2_chunk_forward(**inputs, backend="pytorch"))
        check_result(tilegym_mamba2.mamba2_chunk_forward(**inputs, backend="pytorch"))
        print("ok")
    """))


def test_tilegym_without_the_op():
    """Situation B: a tilegym without mamba2_chunk_forward gets the public op from us."""
    pytest.importorskip("tilegym")
    run_python(textwrap.dedent("""
        import tilegym
        import tilegym.ops
        from tilegym.backend.dispatcher import _REGISTRY
        assert "tilegym_mamba2" not in sys.modules
        del tilegym.ops.mamba2_chunk_forward
        del _REGISTRY["mamba2_chunk_forward"]
        """) + PRELUDE + textwrap.dedent("""
        import tilegym_mamba2
        from tilegym_mamba2.core.registry import LazyImpl

        op = tilegym.ops.mamba2_chunk_forward
        slots = _REGISTRY["mamba2_chunk_forward"]
        assert "tilegym-cutile" not in slots, slots
        assert isinstance(slots["cutile"], LazyImpl) and isinstance(slots["pytorch"], LazyImpl)
        check_result(op(**inputs, backend="pytorch"))

        # The default backend here is cutile: our kernels are chosen and refuse CPU tensors.
        from tilegym.backend.selector import get_current_backend
        assert get_current_backend() == "cutile", get_current_backend()
        try:
            op(**inputs)
        except ValueError as exc:
            assert "CUDA" in str(exc), exc
        else:
            raise AssertionError("the cutile backend accepted CPU tensors")
        print("ok")
    """))


def test_without_tilegym():
    run_python("sys.modules['tilegym'] = None\n" + PRELUDE + textwrap.dedent("""
        import tilegym_mamba2
        from tilegym_mamba2.core import registry
        check_result(tilegym_mamba2.mamba2_chunk_forward(**inputs, backend="pytorch"))
        assert registry.install() is False
        assert sys.modules["tilegym"] is None
        print("ok")
    """))


# What an installed copy is, asked of a fresh interpreter started outside the checkout with the
# checkout off PYTHONPATH. Asking in this process would be wrong: the checkout is on sys.path here,
# and pip's in-tree build leaves tilegym_mamba2.egg-info in it (for `pip install .` and
# `pip install -e .` alike), which importlib.metadata finds before the installed dist-info.
PROBE = textwrap.dedent("""
    import importlib.metadata, importlib.resources, json, os
    try:
        dist = importlib.metadata.distribution("tilegym-mamba2")
        import tilegym_mamba2
    except (importlib.metadata.PackageNotFoundError, ImportError):
        print(json.dumps(None))
        raise SystemExit(0)
    from tilegym_mamba2.core.registry import load_registry
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    resource = importlib.resources.files("tilegym_mamba2").joinpath("ops_registry.yaml")
    print(json.dumps({
        "metadata": str(dist.locate_file("")),
        "editable": bool(direct_url.get("dir_info", {}).get("editable")),
        "module": tilegym_mamba2.__file__,
        "registry": str(resource),
        "registry_is_link": os.path.islink(str(resource)),
        "ops": list(load_registry()),
    }))
""")


def installed_package(cwd) -> dict | None:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).resolve() != REPO]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return json.loads(run_python(PROBE, cwd=cwd, env=env).strip().splitlines()[-1])


def test_registry_found_from_installed_package(tmp_path):
    """The ops of ops_registry.yaml are found by an installed copy, in both install modes:
    a wheel (`pip install .`, what .ci/run does) carries the yaml as a file of its own, and an
    editable install (`pip install -e .`) reads the checkout's top-level ops_registry.yaml."""
    found = installed_package(tmp_path)
    if found is None:
        pytest.skip("tilegym-mamba2 is not installed in this environment (pip install . or -e .)")
    assert OP in found["ops"], found
    module, registry = Path(found["module"]).resolve(), Path(found["registry"]).resolve()
    # A build leaves tilegym_mamba2.egg-info at the checkout's top level; the install's record is
    # in site-packages (which may itself sit inside the checkout, as CI's .venv does).
    assert Path(found["metadata"]).resolve() != REPO, (
        f"read the metadata of the checkout's build directory, not of the install: {found}")
    if found["editable"]:
        assert module.parent == REPO / "tilegym_mamba2", f"editable install imports {module}"
        assert registry == REPO / "ops_registry.yaml", f"editable install reads {registry}"
    else:
        assert module.parent != REPO / "tilegym_mamba2", f"imported the checkout, not the install: {module}"
        assert registry.parent == module.parent and not found["registry_is_link"], (
            f"the installed package must carry ops_registry.yaml as a file of its own: {found}")
        assert registry.read_text() == (REPO / "ops_registry.yaml").read_text(), (
            "the installed ops_registry.yaml differs from the checkout's: reinstall (pip install .)")


@pytest.mark.parametrize("text", [
    "ops: [mamba2_chunk_forward]",
    "ops:\n  my_op: nonsense\n",
    "ops:\n  my_op:\n    backends: [pytorch]\n    fallback: pytorch\n",
    "nothing: here\n",
])
def test_malformed_structure_is_a_clear_error(text):
    with pytest.raises(ValueError, match="ops_registry.yaml"):
        load_registry(text)


def test_reloaded_registry_does_not_displace_our_own():
    """After importlib.reload(registry) the LazyImpl class is new; install() must still know
    the registered implementations are ours and leave 'tilegym-cutile' to tilegym's."""
    script = textwrap.dedent("""
        import importlib
        import tilegym
        from tilegym.backend.dispatcher import _REGISTRY
        import tilegym_mamba2, tilegym_mamba2.core.registry as registry
        before = _REGISTRY["mamba2_chunk_forward"].get("tilegym-cutile")
        importlib.reload(registry)
        registry.install()
        after = _REGISTRY["mamba2_chunk_forward"].get("tilegym-cutile")
        assert after is before, (before, after)
        assert not getattr(after, "is_tilegym_mamba2_impl", False)
        print("ok")
    """)
    assert "ok" in run_python(script)


def test_importing_the_plugin_changes_no_tilegym_op_but_the_declared_drop_ins():
    """A snapshot of tilegym's registry before and after `import tilegym_mamba2`: every op keeps
    every backend it had, with the same implementation and public signature; a declared drop-in's
    taken slot moves to its `displaces` name; tilegym's own rms_norm is still what tilegym.ops.rms_norm
    calls (on a CPU it fails exactly as it did before the import) and ours has a name of its own."""
    pytest.importorskip("tilegym")
    run_python(textwrap.dedent("""
        import inspect
        import torch
        import tilegym
        import tilegym.ops
        from tilegym.backend.dispatcher import _REGISTRY
        before = {op: dict(slots) for op, slots in _REGISTRY.items()}
        public = {op: getattr(tilegym.ops, op) for op in before if hasattr(tilegym.ops, op)}
        signatures = {op: str(inspect.signature(f)) for op, f in public.items()}

        def outcome():
            try:
                return repr(tilegym.ops.rms_norm(torch.ones(2, 8), (8,), torch.ones(8), 1e-6))
            except Exception as e:
                return f"{type(e).__name__}: {e}"
        rms_norm_before = outcome()

        import tilegym_mamba2
        from tilegym_mamba2.core.registry import shipped_registry
        entries = shipped_registry()
        for op, slots in before.items():
            entry = entries.get(op)
            for backend, impl in slots.items():
                taken = entry is not None and backend in entry.backends
                assert entry is None or not taken or entry.displaces, (op, backend, "taken without displaces")
                where = entry.displaces if taken else backend
                assert _REGISTRY[op][where] is impl, (op, backend, where)
        for op, f in public.items():
            assert getattr(tilegym.ops, op) is f, op
            assert str(inspect.signature(getattr(tilegym.ops, op))) == signatures[op], op
        assert outcome() == rms_norm_before, (outcome(), rms_norm_before)
        assert "mamba2_rms_norm" in _REGISTRY and hasattr(tilegym.ops, "mamba2_rms_norm")
        x, w = torch.randn(3, 8), torch.rand(8)
        ours = tilegym.ops.mamba2_rms_norm(x, w, backend="pytorch")
        torch.testing.assert_close(ours, w * x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6))
        print("ok")
    """))


def test_an_op_that_would_shadow_one_of_tilegyms_is_refused_before_any_change():
    pytest.importorskip("tilegym")
    run_python(textwrap.dedent("""
        import tilegym
        from tilegym.backend.dispatcher import _REGISTRY
        import tilegym_mamba2
        from tilegym_mamba2.core.registry import install, load_registry
        snapshot = {op: dict(slots) for op, slots in _REGISTRY.items()}
        entries = load_registry('''
        ops:
          an_op_of_our_own:
            backends: {pytorch: "tilegym_mamba2.backends.pytorch:rms_norm_pytorch"}
            fallback: pytorch
          rms_norm:
            backends: {cutile: "tilegym_mamba2.serving.rms_norm:rms_norm",
                       pytorch: "tilegym_mamba2.backends.pytorch:rms_norm_pytorch"}
            fallback: pytorch
        ''')
        try:
            install(entries)
        except RuntimeError as e:
            message = str(e)
        else:
            raise AssertionError("an op shadowing tilegym's rms_norm was registered")
        assert "op 'rms_norm' would shadow tilegym's own tilegym.ops.rms_norm" in message, message
        assert "displaces" in message, message
        assert {op: dict(slots) for op, slots in _REGISTRY.items()} == snapshot, "something was registered"
        print("ok")
    """))


@pytest.mark.gpu
def test_tilegyms_own_rms_norm_runs_on_the_gpu_after_the_import():
    """What a TileGym-patched Llama calls in the same process as us: tilegym's general RMSNorm,
    (input, normalized_shape, weight, eps), against torch's."""
    pytest.importorskip("tilegym")
    run_python(textwrap.dedent("""
        import torch
        import tilegym
        import tilegym_mamba2
        tilegym.set_backend("cutile")
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(256, device="cuda", dtype=torch.bfloat16)
        got = tilegym.ops.rms_norm(x, (256,), w, 1e-6)
        want = torch.nn.functional.rms_norm(x.float(), (256,), w.float(), 1e-6)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 1e-2, err
        print("ok")
    """))
