"""The earlier releases' import paths: each old name is the module at its new home (the same object,
so monkeypatching either reaches the code), with one FutureWarning naming the new path."""
import importlib
import subprocess
import sys
import warnings

import pytest

import tilegym_mamba2
from tilegym_mamba2 import moved


@pytest.mark.parametrize("old", sorted(name for name, new in moved.MOVED.items() if isinstance(new, str)))
def test_an_old_module_name_is_its_new_module(old):
    new = importlib.import_module(f"tilegym_mamba2.{moved.MOVED[old]}")
    assert importlib.import_module(f"tilegym_mamba2.{old}") is new


def test_every_new_home_exists_and_every_old_file_is_gone():
    import os
    root = os.path.dirname(tilegym_mamba2.__file__)
    for old, new in moved.MOVED.items():
        assert not os.path.exists(os.path.join(root, *old.split(".")) + ".py"), f"{old}.py is back: drop its alias"
        for home in (new,) if isinstance(new, str) else new or ():
            importlib.import_module(f"tilegym_mamba2.{home}")


@pytest.mark.parametrize("old, names", [
    ("reference.scan", ("scan_reference", "chunk_grads_reference", "chunk_entry_states")),
    ("reference.layer", ("layer_token_recurrence", "process_dt", "process_dt_slope", "gate_dy_reference")),
    ("reference.ssd", ("token_recurrence", "decay_cumsum_reference", "chunk_states_reference", "chunked")),
])
def test_an_old_module_whose_functions_moved_apart_still_has_them(old, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        module = importlib.import_module(f"tilegym_mamba2.{old}")
    for name in names:
        assert callable(getattr(module, name)), name
    with pytest.raises(AttributeError, match="no_such_function"):
        module.no_such_function


def test_an_old_name_warns_once_with_the_new_path():
    # A fresh interpreter: this process may have imported the old names already.
    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    import tilegym_mamba2.cutile.plan as a\n"
            "    from tilegym_mamba2.cutile import plan as b\n"
            "    import tilegym_mamba2.reference.ssd\n"
            "import tilegym_mamba2.runtime.plan as c\n"
            "assert a is b is c\n"
            "found = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]\n"
            "print('\\n'.join(found))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert sum("tilegym_mamba2.cutile.plan is an old import path" in line for line in lines) == 1, lines
    assert any("import tilegym_mamba2.runtime.plan instead" in line for line in lines), lines
    assert any("tilegym_mamba2.reference.ssd is an old import path: its functions moved to "
               "tilegym_mamba2.ssd.reference.forward" in line for line in lines), lines


def test_an_unknown_name_under_an_old_package_is_still_an_import_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("tilegym_mamba2.cutile.no_such_stage")
