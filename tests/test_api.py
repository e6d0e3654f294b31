"""The public surface and the architecture rules of DESIGN.md §2, checked on the source itself.

* imports flow downward only through the layers (relative, absolute and function-level imports);
* no module below the torch layer imports torch at module level; L1/L2 never use multiprocessing;
* ``shardio.__all__`` is pinned; ``import shardio`` and ``shardio pack`` never load torch;
* every exception class lives in ``shardio/errors.py`` and derives from ``ShardioError``.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio import errors

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "shardio"

# DESIGN.md §2.  A module missing here fails test_every_module_has_a_layer: add it to the table
# in DESIGN.md and here in the same change.
LAYERS: dict[str, int] = {
    "errors": 0, "_fsutil": 0, "checksum": 0, "_atomics": 0, "_inject": 0,
    "_tarpack": 0, "_sampleio": 0,  # C extensions (shardio/*.c): no shardio imports
    "config": 1, "topology": 1, "manifest": 1, "codec": 1,
    "formats": 2, "lustre": 2, "decode": 2,
    "packer": 3, "_scan": 3, "reader": 3, "verify": 3, "summary": 3, "indexer": 3, "stage": 3,
    "repair": 3, "parity": 3, "ring": 3, "_tree": 3, "storagebench": 3, "parts": 3,
    "_packpool": 3, "stageplan": 3, "nodecache": 3, "packplan": 3, "packstate": 3, "shmspace": 3,
    "pool": 4, "order": 4,
    "dataset": 5, "loader": 5, "stats": 5, "loaderbench": 5, "sharedbytes": 5,
    "cli": 6, "__main__": 6, "__init__": 6,
}
# codec sits beside config but is used by the shard formats, so it may import only L0.
MAX_IMPORTED_LAYER = {"codec": 0}
# The command line and the package's lazy front door may import anything.
UNRESTRICTED = {"cli", "__init__"}
TORCH_FREE_LAYERS = range(0, 5)
NO_MULTIPROCESSING_LAYERS = (1, 2)

# Names whose access would load torch by design (lazy attributes of ``shardio``).
TORCH_EXPORTS = {"ShardDataset", "ShardLoader", "zero_copy_collate"}

EXPECTED_ALL = [
    "DatasetReader",
    "LoaderOptions",
    "Manifest",
    "PackOptions",
    "ReadOptions",
    "ShardDataset",
    "ShardLoader",
    "Topology",
    "__version__",
    "describe",
    "errors",
    "index_tars",
    "merge",
    "open_dataset",
    "pack",
    "verify_dataset",
    "zero_copy_collate",
]


# --- import graph ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    module: str  # importing module, dotted, e.g. "shardio.formats.tar"
    target: str  # imported module (or the package an attribute comes from)
    name: str | None  # attribute imported from ``target``, when it is not a submodule
    line: int
    in_function: bool
    type_checking: bool

    def where(self) -> str:
        return f"{self.module.replace('.', '/')}.py:{self.line}"


def _modules() -> dict[str, Path]:
    """Dotted name -> file for every module of the package (packages by their __init__)."""
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1 and parts != ["shardio", "__init__"]:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer_key(dotted: str) -> str:
    """The DESIGN.md table entry of a module: ``shardio.formats.tar`` -> ``formats``."""
    parts = dotted.split(".")
    if parts == ["shardio"] or parts == ["shardio", "__init__"]:
        return "__init__"
    return parts[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(dotted: str) -> list[Import]:
    path = MODULES[dotted]
    # The package relative imports start from: the module's own for a package __init__.
    is_package = path.name == "__init__.py" and dotted != "shardio.__init__"
    package = dotted if is_package else dotted.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def resolve_from(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = package.split(".")
        if node.level > 1:
            base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(dotted, alias.name, None, node.lineno, in_function,
                                    type_checking))
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:
                    found.append(Import(dotted, sub, None, node.lineno, in_function,
                                        type_checking))
                else:
                    found.append(Import(dotted, base, alias.name, node.lineno, in_function,
                                        type_checking))
        elif isinstance(node, ast.Call) and _is_import_module_call(node):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(dotted, arg.value, None, node.lineno, in_function,
                                    type_checking))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, in_function, type_checking)

    visit(tree, False, False)
    return found


def _is_import_module_call(node: ast.Call) -> bool:
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("import_module", "__import__") and bool(node.args)


def _is_shardio(target: str) -> bool:
    return target == "shardio" or target.startswith("shardio.")


def test_module_walk_finds_the_package() -> None:
    # Guard the walker itself: it sees nested packages and resolves relative imports.
    assert {"shardio.__init__", "shardio.errors", "shardio.formats", "shardio.formats.tar",
            "shardio.packer", "shardio.cli"} <= set(MODULES)
    tar = {(i.target, i.name) for i in imports_of("shardio.formats.tar")}
    assert ("shardio.codec", "Codec") in tar and ("shardio.formats.base", "IndexBuilder") in tar
    state = {(i.target, i.name) for i in imports_of("shardio.packstate")}
    assert ("shardio", "__version__") in state and ("shardio.formats", "load_index") in state
    cli = {i.target for i in imports_of("shardio.cli") if i.in_function}
    assert "shardio.packer" in cli  # per-command imports inside functions are seen


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in MODULES if layer_key(m) not in LAYERS)
    assert not missing, (
        f"modules without a layer: {missing}; add them to the layers table of DESIGN.md §2 and "
        "to LAYERS in tests/test_api.py")


def test_imports_flow_downward() -> None:
    problems = []
    for mod in MODULES:
        key = layer_key(mod)
        if key in UNRESTRICTED or key not in LAYERS:
            continue
        own = LAYERS[key]
        limit = MAX_IMPORTED_LAYER.get(key, own)
        for imp in imports_of(mod):
            if not _is_shardio(imp.target) or imp.type_checking:
                continue
            if imp.target == "shardio" and imp.name == "__version__":
                # The package root is executed before any submodule anyway, and it imports
                # nothing of shardio at module level (test_package_root_is_lazy), so reading
                # its version string adds no dependency.
                continue
            target_key = layer_key(imp.target)
            if target_key not in LAYERS:
                continue  # reported by test_every_module_has_a_layer
            if LAYERS[target_key] > limit:
                what = imp.target + (f" ({imp.name})" if imp.name else "")
                how = " inside a function" if imp.in_function else ""
                problems.append(f"{imp.where()}: {key} (L{own}) imports {what} "
                                f"(L{LAYERS[target_key]}){how}")
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_package_root_is_lazy() -> None:
    eager = [i for i in imports_of("shardio.__init__")
             if _is_shardio(i.target) and not i.in_function and not i.type_checking]
    assert eager == [], "shardio/__init__.py must load its exports lazily (__getattr__)"


def test_no_torch_at_module_level_below_l5() -> None:
    problems = []
    for mod in MODULES:
        if LAYERS.get(layer_key(mod), 99) not in TORCH_FREE_LAYERS:
            continue
        for imp in imports_of(mod):
            root = imp.target.split(".")[0]
            if root == "torch" and not imp.in_function and not imp.type_checking:
                problems.append(f"{imp.where()}: imports {imp.target} at module level")
    assert not problems, "\n".join(problems)


def test_no_multiprocessing_in_l1_l2() -> None:
    problems = []
    for mod in MODULES:
        if LAYERS.get(layer_key(mod), 99) not in NO_MULTIPROCESSING_LAYERS:
            continue
        for imp in imports_of(mod):
            if (imp.target.split(".")[0] == "multiprocessing"
                    or imp.target == "concurrent.futures.process"
                    or (imp.target == "concurrent.futures" and imp.name == "ProcessPoolExecutor")):
                problems.append(f"{imp.where()}: imports {imp.target} {imp.name or ''}")
    assert not problems, "\n".join(problems)


# --- public surface --------------------------------------------------------------------------


def test_all_is_pinned() -> None:
    assert shardio.__all__ == EXPECTED_ALL, (
        "shardio.__all__ changed: update EXPECTED_ALL in tests/test_api.py deliberately")
    assert sorted(shardio.__all__) == shardio.__all__
    assert set(EXPECTED_ALL) <= set(dir(shardio))


def test_every_export_resolves() -> None:
    for name in EXPECTED_ALL:
        if name in TORCH_EXPORTS:
            continue  # resolved in a torch-bearing test; here it would load torch for nothing
        assert getattr(shardio, name) is not None, name
    assert shardio.errors is errors
    assert isinstance(shardio.__version__, str)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        shardio.nope  # noqa: B018


def _run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", code, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=env)
    except subprocess.TimeoutExpired as exc:
        print(f"$ {cmd}\nTIMEOUT\n--- stdout ---\n{exc.stdout}\n--- stderr ---\n{exc.stderr}")
        raise
    print(f"$ {cmd}\nrc={proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n"
          f"{proc.stderr}")
    assert proc.returncode == 0
    return proc


_HEAVY = ("import json, sys\n"
          "print(json.dumps(sorted(m for m in ('torch', 'h5py') if m in sys.modules)))")


def _loaded(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_import_shardio_is_light() -> None:
    light = sorted(set(EXPECTED_ALL) - TORCH_EXPORTS)
    proc = _run_python(f"import shardio\nfor n in {light!r}: getattr(shardio, n)\n{_HEAVY}")
    assert _loaded(proc) == []


def test_import_packer_does_not_load_torch() -> None:
    proc = _run_python(f"from shardio.packer import pack\nimport shardio.cli\n{_HEAVY}")
    assert _loaded(proc) == []


def test_cli_pack_does_not_load_torch(tmp_path: Path) -> None:
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(5):
        (src / f"s{i}.txt").write_text(f"sample {i}")
        (src / f"s{i}.json").write_text(json.dumps({"i": i}))
    code = ("import sys\nfrom shardio.cli import main\n"
            "rc = main(['pack', sys.argv[1], sys.argv[2], '--samples-per-shard', '2'])\n"
            "assert rc == 0, rc\n"
            "assert main(['verify', sys.argv[2], '--workers', '1']) == 0\n" + _HEAVY)
    proc = _run_python(code, str(tmp_path / "src"), str(tmp_path / "out"))
    assert "packed 5 samples (80 B; 10 files)" in proc.stdout
    assert _loaded(proc) == []  # neither torch nor h5py for a tar pack


# --- exceptions ------------------------------------------------------------------------------


def _error_classes() -> dict[str, type]:
    return {n: c for n, c in vars(errors).items()
            if inspect.isclass(c) and c.__module__ == errors.__name__}


def test_every_error_derives_from_shardio_error() -> None:
    classes = _error_classes()
    assert len(classes) > 10
    for name, cls in classes.items():
        assert issubclass(cls, errors.ShardioError), name
        assert issubclass(cls, Exception), name
    assert sorted(errors.__all__) == sorted(classes)
    # The tree in the module docstring names every class.
    doc = errors.__doc__ or ""
    assert [n for n in classes if n not in doc] == []


def _importable(mod: str) -> object | None:
    name = "shardio" if mod == "shardio.__init__" else mod
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if exc.name and not exc.name.startswith("shardio"):
            return None  # an optional dependency is missing; the AST check still covers it
        raise


def test_exceptions_live_in_errors_module() -> None:
    problems = []
    for mod in MODULES:
        if mod == "shardio.errors" or mod == "shardio.__main__":
            continue
        # Source level: any class whose base looks like an exception, nested ones included.
        tree = ast.parse(MODULES[mod].read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                bname = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                builtin = getattr(builtins, bname, None)
                if (bname.endswith(("Error", "Exception", "Warning", "Exit", "Interrupt"))
                        or (inspect.isclass(builtin) and issubclass(builtin, BaseException))):
                    problems.append(f"{mod}:{node.lineno}: class {node.name}({bname})")
        # Runtime: classes the module defines that are exceptions, whatever their base is named.
        module = _importable(mod)
        if module is None:
            continue
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and obj.__module__ == module.__name__
                    and issubclass(obj, BaseException)):
                problems.append(f"{mod}: exception class {name}")
    assert not problems, ("exception classes outside shardio/errors.py (move them there):\n"
                          + "\n".join(sorted(set(problems))))


def test_a_ctrl_c_python_swallows_still_ends_the_command_as_interrupted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Ctrl-C whose KeyboardInterrupt landed in a ``__del__`` or a weakref callback was
    printed as "Exception ignored ... Traceback" and swallowed by Python: the pack of the CI
    run it happened in went on and exited 0.  The CLI now remembers it: exit 130, no
    traceback."""
    from shardio import cli

    class Dropped:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, inside __del__
                pass

    def command(args: Any) -> int:
        Dropped()
        return 0

    monkeypatch.setitem(cli._COMMANDS, "inspect", command)
    assert cli.main(["inspect", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
