"""Toolchain lookup and diagnosis, on fake toolkits built in tmp_path.

The fakes are shell scripts that print what the real tileiras and ptxas print for
``--version``, libnvvm stand-ins that carry the same release string as the real library,
and CUDA_HOME-like directories with a version.json.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tilegym_mamba2.core import toolchain as tcm

# Real `--version` output of tileiras / ptxas 13.4.92, with the release left open.
TILEIRAS_VERSION = """\
tileiras: NVIDIA (R) Cuda Tile IR optimizing assembler
Copyright (c) 2005-2026 NVIDIA Corporation
Built on Tue_Sep__1_09:35:26_PDT_2026
Cuda compilation tools, release {mm}, V{v}
Build local.local.38855100_"""
PTXAS_VERSION = """\
ptxas: NVIDIA (R) Ptx optimizing assembler
Copyright (c) 2005-2026 NVIDIA Corporation
Built on Tue_Sep_01_08:45:21_PDT_2026
Cuda compilation tools, release {mm}, V{v}
Build cuda_{mm}.r{mm}/compiler.38855100_0"""

NEW, OLD = "13.4.92", "13.0.88"


def _script(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"printf '%s\\n' '{line}'\n" for line in text.splitlines())
    path.write_text("#!/bin/sh\n" + lines)
    path.chmod(0o755)


def make_toolkit(root, version=NEW, *, tileiras=None, ptxas=None, libnvvm=None,
                 libnvvm_at="lib/libnvvm.so.4", version_json=True):
    """A fake CUDA toolkit; each component takes ``version`` unless given its own
    (False leaves it out)."""
    def mm(v):
        return ".".join(v.split(".")[:2])

    for name, fmt, v in (("tileiras", TILEIRAS_VERSION, tileiras),
                         ("ptxas", PTXAS_VERSION, ptxas)):
        v = version if v is None else v
        if v:
            _script(root / "bin" / name, fmt.format(mm=mm(v), v=v))
    v = version if libnvvm is None else libnvvm
    if v:
        lib = root / libnvvm_at
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"\x7fELF" + b"\0" * 4096 + f"Cuda compilation tools, release "
                        f"{mm(v)}, V{v}\0\0Build cuda_{mm(v)}".encode())
    if version_json:
        (root / "version.json").write_text(json.dumps({"cuda": {"name": "CUDA SDK",
                                                                "version": version}}))
    return root


@pytest.fixture
def isolated(monkeypatch):
    """Hide the venv's pip wheels and /usr/local/cuda* from the lookup."""
    monkeypatch.setattr(tcm, "_pip_install", lambda: (None, {}))
    monkeypatch.setattr(tcm, "_system_cuda_roots", lambda: [])


def fake_pip(monkeypatch, root, versions=(NEW, NEW, NEW)):
    wheels = dict(zip(tcm.PIP_PACKAGES, versions))
    monkeypatch.setattr(tcm, "_pip_install", lambda: (str(root), wheels))
    monkeypatch.setattr(tcm, "_system_cuda_roots", lambda: [])


def path_env(*roots, **extra):
    return {"PATH": os.pathsep.join(str(r / "bin") for r in roots), **extra}


# ---------------------------------------------------------------- consistent setups

def test_pip_toolchain_ignores_old_cuda_home(tmp_path, monkeypatch):
    # cuTile drops CUDA_HOME for the pip wheels, so an old system CUDA does no harm.
    pip_root = make_toolkit(tmp_path / "cu13", version_json=False)
    old = make_toolkit(tmp_path / "cuda-13.0", OLD, tileiras=False)
    fake_pip(monkeypatch, pip_root)
    env = path_env(old, CUDA_HOME=str(old))
    tc = tcm.find_toolchain(env)
    assert tc.found_via == "pip" and not tc.passes_cuda_home
    assert tc.tileiras == str(pip_root / "bin" / "tileiras")
    assert tc.toolkit_root == str(pip_root) and tc.toolkit_root_var is None
    assert (tc.tileiras_version, tc.ptxas_version, tc.libnvvm_version) == ((13, 4, 92),) * 3
    assert tc.cuda_home_var == "CUDA_HOME" and tc.cuda_home_version == (13, 0, 88)
    assert tcm.diagnose(tc) == []
    assert env == path_env(old, CUDA_HOME=str(old))  # only read, never changed


def test_path_toolchain_with_nvvm_layout_is_fine(tmp_path, isolated):
    root = make_toolkit(tmp_path / "cuda-13.4", libnvvm_at="nvvm/lib64/libnvvm.so")
    tc = tcm.find_toolchain(path_env(root))
    assert tc.found_via == "PATH" and tc.passes_cuda_home
    assert tc.libnvvm == str(root / "nvvm/lib64/libnvvm.so")
    assert tc.ptxas == str(root / "bin" / "ptxas")
    assert tcm.diagnose(tc) == []
    assert "status   : OK for sm_90" in tcm.describe(tc)


def test_tileiras_found_under_cuda_home(tmp_path, isolated):
    root = make_toolkit(tmp_path / "cuda-13.4")
    tc = tcm.find_toolchain({"PATH": "", "CUDA_HOME": str(root)})
    assert tc.found_via == "CUDA_HOME" and tc.toolkit_root_var == "CUDA_HOME"
    assert tcm.diagnose(tc) == []


# ---------------------------------------------------------------- failure modes

def test_no_tileiras(tmp_path, isolated):
    tc = tcm.find_toolchain(path_env(make_toolkit(tmp_path / "cuda", tileiras=False)))
    assert tc.tileiras is None
    [problem] = tcm.diagnose(tc)
    assert "No tileiras" in problem and tcm.INSTALL_HINT in problem and "13.3" in problem
    assert "tileiras : not found" in tcm.describe(tc)


def test_cuda_home_older_than_tileiras(tmp_path, isolated):
    # The GPU machine's setup: tileiras 13.4 on PATH, CUDA_HOME on the image's CUDA 13.0.
    new = make_toolkit(tmp_path / "tk" / "cu13", version_json=False)
    old = make_toolkit(tmp_path / "cuda-13.0", OLD, tileiras=False)
    tc = tcm.find_toolchain(path_env(new, CUDA_HOME=str(old)))
    assert tc.toolkit_root_var == "CUDA_HOME" and tc.toolkit_root_version == (13, 0, 88)
    assert tc.ptxas == str(old / "bin" / "ptxas") and tc.libnvvm_version == (13, 0, 88)
    [problem] = tcm.diagnose(tc)  # one entry, not one per component
    assert "CUDA_HOME" in problem and "exit code 5" in problem and "13.0.88" in problem
    assert str(new) in problem and "unset" in problem


def test_cuda_path_is_honoured_like_cuda_home(tmp_path, isolated):
    new = make_toolkit(tmp_path / "new")
    old = make_toolkit(tmp_path / "old", OLD, tileiras=False)
    [problem] = tcm.diagnose(tcm.find_toolchain(path_env(new, CUDA_PATH=str(old))))
    assert problem.startswith(f"CUDA_PATH={old} is CUDA 13.0.88")


def test_cuda_root_reaches_even_pip_tileiras(tmp_path, monkeypatch):
    # cuTile strips CUDA_HOME/CUDA_PATH for the wheels but not CUDA_ROOT, which tileiras
    # reads first.
    pip_root = make_toolkit(tmp_path / "cu13", version_json=False)
    old = make_toolkit(tmp_path / "cuda-13.0", OLD, tileiras=False)
    fake_pip(monkeypatch, pip_root)
    tc = tcm.find_toolchain({"PATH": "", "CUDA_ROOT": str(old), "CUDA_HOME": str(pip_root)})
    assert tc.found_via == "pip" and tc.toolkit_root_var == "CUDA_ROOT"
    [problem] = tcm.diagnose(tc)
    assert "CUDA_ROOT" in problem and "exit code 5" in problem


def test_empty_cuda_home(tmp_path, isolated):
    root = make_toolkit(tmp_path / "cuda-13.4")
    [problem] = tcm.diagnose(tcm.find_toolchain(path_env(root, CUDA_HOME="")))
    assert "CUDA_HOME is set but empty" in problem and "exit code 5" in problem


@pytest.mark.parametrize("old_part", ["ptxas", "libnvvm"])
def test_mixed_releases_in_one_toolkit(tmp_path, isolated, old_part):
    root = make_toolkit(tmp_path / "cuda", **{old_part: OLD})
    tc = tcm.find_toolchain(path_env(root))
    [problem] = tcm.diagnose(tc)
    assert problem.startswith(f"{old_part} 13.0.88") and "tileiras 13.4.92" in problem
    assert tcm.INSTALL_HINT in problem
    assert "1 problem(s)" in tcm.describe(tc)


def test_ptxas_taken_from_path_when_toolkit_has_none(tmp_path, isolated):
    root = make_toolkit(tmp_path / "cuda-13.4", ptxas=False)
    old = make_toolkit(tmp_path / "cuda-13.0", OLD, tileiras=False)
    tc = tcm.find_toolchain(path_env(root, old))
    assert tc.ptxas == str(old / "bin" / "ptxas")
    [problem] = tcm.diagnose(tc)
    assert problem.startswith("ptxas 13.0.88") and "from PATH" in problem


def test_missing_ptxas_and_libnvvm(tmp_path, isolated):
    root = make_toolkit(tmp_path / "cuda", ptxas=False, libnvvm=False)
    problems = tcm.diagnose(tcm.find_toolchain(path_env(root)))
    assert len(problems) == 2
    assert "libnvvm" in problems[0] and "no ptxas" in problems[1]


def test_old_tileiras_cannot_target_hopper(tmp_path, isolated):
    tc = tcm.find_toolchain(path_env(make_toolkit(tmp_path / "cuda-13.2", "13.2.51")))
    assert tc.tileiras_version == (13, 2, 51)
    [problem] = tcm.diagnose(tc, target="sm_90")
    assert "Hopper" in problem and "13.3" in problem
    assert tcm.diagnose(tc, target="sm_100") == []


def test_mismatched_pip_wheels_fall_back_to_path(tmp_path, monkeypatch):
    pip_root = make_toolkit(tmp_path / "cu13")
    system = make_toolkit(tmp_path / "cuda-13.4")
    fake_pip(monkeypatch, pip_root, versions=(NEW, OLD, NEW))
    tc = tcm.find_toolchain(path_env(system))
    assert tc.found_via == "PATH" and tc.tileiras == str(system / "bin" / "tileiras")
    [problem] = tcm.diagnose(tc)
    assert "nvidia-cuda-nvcc 13.0.88" in problem and "ignores them" in problem


def test_cuda_version_at(tmp_path):
    assert tcm.cuda_version_at(make_toolkit(tmp_path / "a", "12.8.1")) == (12, 8, 1)
    txt = tmp_path / "b"
    txt.mkdir()
    (txt / "version.txt").write_text("CUDA Version 11.8.89\n")
    assert tcm.cuda_version_at(txt) == (11, 8, 89)
    # No version file: ask the toolkit's own ptxas.
    bare = make_toolkit(tmp_path / "c", OLD, version_json=False)
    assert tcm.cuda_version_at(bare) == (13, 0, 88)
    assert tcm.cuda_version_at(tmp_path / "missing") is None


# ---------------------------------------------------------------- compile failures

def test_explain_compile_failure(tmp_path, isolated):
    exc_mod = pytest.importorskip("cuda.tile._exception")
    new = make_toolkit(tmp_path / "new")
    old = make_toolkit(tmp_path / "old", OLD, tileiras=False)
    exit5 = exc_mod.TileCompilerExecutionError(
        5, "failed to compile Tile IR program", exc_mod.Loc.unknown(), "--gpu-name sm_90 -O3", None)

    msg = tcm.explain_compile_failure(exit5, tcm.find_toolchain(path_env(new, CUDA_HOME=str(old))))
    assert "exit code 5" in msg and "sm_90" in msg and f"CUDA_HOME={old}" in msg
    # A sound toolchain means the failure is in the kernel, not the setup.
    assert tcm.explain_compile_failure(exit5, tcm.find_toolchain(path_env(new))) is None
    assert tcm.explain_compile_failure(ValueError("bad tile shape")) is None


def test_explain_unknown_gpu_name_and_missing_tileiras(tmp_path, isolated):
    exc_mod = pytest.importorskip("cuda.tile._exception")
    old = tcm.find_toolchain(path_env(make_toolkit(tmp_path / "cuda-13.2", "13.2.51")))
    exc = exc_mod.TileCompilerExecutionError(
        1, "tileiras: for the --gpu-name option: Cannot find option named 'sm_90'!",
        exc_mod.Loc.unknown(), "", None)
    assert "Hopper" in tcm.explain_compile_failure(exc, old)

    missing = FileNotFoundError("'tileiras' compiler not found, make sure it is available ...")
    msg = tcm.explain_compile_failure(missing, tcm.Toolchain())
    assert msg.startswith("cuTile could not find tileiras") and tcm.INSTALL_HINT in msg


# ---------------------------------------------------------------- the real toolchain

def _real_env():
    # The user's own CUDA variables are not what this test is about.
    return {k: v for k, v in os.environ.items() if k not in ("CUDA_ROOT", "CUDA_HOME", "CUDA_PATH")}


def test_real_venv_toolchain_is_consistent():
    tc = tcm.find_toolchain(_real_env())
    if tc.tileiras is None:
        pytest.skip("tileiras is not installed")
    assert tc.tileiras_version is not None and tc.tileiras_version >= (13, 1)
    assert tc.ptxas and tc.libnvvm
    assert tc.ptxas_version[:2] == tc.libnvvm_version[:2] == tc.tileiras_version[:2]
    assert tcm.diagnose(tc, target="sm_100") == []


def test_real_exit_code_5_is_explained(tmp_path):
    """Compile a kernel with the real tileiras pointed at an old toolkit (no GPU needed)."""
    pytest.importorskip("cuda.tile")
    if tcm.find_toolchain(_real_env()).tileiras is None:
        pytest.skip("tileiras is not installed")
    old = make_toolkit(tmp_path / "cuda-13.0", "13.0.2", tileiras=False)
    script = textwrap.dedent("""
        import cuda.tile as ct
        from cuda.tile.compilation import (ArrayConstraint, CallingConvention,
                                           KernelSignature, export_kernel)
        from tilegym_mamba2.core.toolchain import explain_compile_failure

        @ct.kernel
        def add_one(a, b):
            ct.store(b, index=(0,), tile=ct.load(a, index=(0,), shape=(16,)) + 1)

        arr = ArrayConstraint(ct.float32, 1, index_dtype=ct.int32, stride_lower_bound_incl=0,
                              alias_groups=(), may_alias_internally=False)
        sig = KernelSignature([arr, arr], CallingConvention.cutile_python_v1())
        try:
            export_kernel(add_one, [sig], "k.cubin", output_format="cubin",
                          gpu_code="sm_90", bytecode_version="13.3")
        except Exception as exc:
            print(explain_compile_failure(exc))
        else:
            print("COMPILED")
    """)
    env = dict(_real_env(), CUDA_ROOT=str(old), CUDA_TILE_CACHE_DIR="off",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(tcm.__file__))))
    (tmp_path / "compile_it.py").write_text(script)  # cuTile reads the kernel's source file
    res = subprocess.run([sys.executable, "compile_it.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "tileiras failed with exit code 5 compiling for sm_90" in res.stdout
    assert f"CUDA_ROOT={old} is CUDA 13.0.2" in res.stdout


def test_import_runs_no_subprocess():
    # torch, cuda.tile and tilegym may run subprocesses of their own at import (ctypes'
    # find_library calls ldconfig when cuda-bindings is installed): import them first, so
    # only our own import is watched.
    code = ("import subprocess, torch, cuda.tile\n"
            "try:\n    import tilegym\nexcept ImportError:\n    pass\n"
            "def refuse(*a, **k): raise AssertionError('subprocess at import')\n"
            "subprocess.run = subprocess.Popen = refuse\n"
            "import tilegym_mamba2.core.toolchain\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(tcm.__file__))))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
