"""A package module with textual edits, loaded from a copy: how this folder's variants try a kernel
change without touching the package."""
import importlib.util
import pathlib
import tempfile


def module_from(path, edits=(), stem=None):
    """The module at ``path`` with ``edits``, (old, new) pairs each of which must apply once; its
    relative imports made absolute: from tilegym_mamba2/ for a module there, else from
    tilegym_mamba2/cutile/ (the package's kernel modules and this folder's copies of old ones)."""
    package = "tilegym_mamba2" if path.parent.name == "tilegym_mamba2" else "tilegym_mamba2.cutile"
    parent = package.rsplit(".", 1)[0]
    text = (path.read_text().replace("from .. import", f"from {parent} import").replace("from ..", f"from {parent}.")
            .replace("from . import", f"from {package} import").replace("from .", f"from {package}."))
    for old, new in edits:
        assert text.count(old) == 1, f"{old!r} is not in {path.name} once"
        text = text.replace(old, new)
    copy = pathlib.Path(tempfile.mkdtemp()) / f"{stem or path.stem}.py"
    copy.write_text(text)
    spec = importlib.util.spec_from_file_location(copy.stem, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
