"""The package's layout rules (docs/design.md, "Layout"), read from the source with ``ast``: imports go
down the stack of stages, and no module imports another module's private (``_name``) names.

ruff's PLC2701 only sees private names imported from other distributions, so the rule for
tvrpipe's own modules is checked here (``make test`` and CI run it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tvrpipe"

# The stack, bottom first: a module may import its own stage and any stage below it, never one above.
LAYERS = {
    "tvrpipe": 0, "tvrpipe.errors": 0, "tvrpipe.config": 0, "tvrpipe.environment": 0, "tvrpipe.lock": 0,
    "tvrpipe.files": 0, "tvrpipe.cluster": 0, "tvrpipe.progress": 0,
    "tvrpipe.heads": 1,
    "tvrpipe.rundir": 2,  # the run directory: trainers write it, report and evaluation read it (heads for its weights)
    "tvrpipe.data": 2,
    "tvrpipe.features": 3, "tvrpipe.evaluation": 3,
    "tvrpipe.training": 4, "tvrpipe.worlds": 4,  # generated worlds write manifests and stores
    "tvrpipe.report": 5, "tvrpipe.bench": 5, "tvrpipe.sweep": 5, "tvrpipe.search": 5,
    "tvrpipe.quickstart": 6,
    "tvrpipe.cli": 7, "tvrpipe.__main__": 7,
}

# What a stage must not import although the stack would allow it (a stage or a module, with what is below it):
# search reads stores and runs (features, rundir) and encodes with a head, it never trains; the trainers share
# the manifest's checks (data) and the failure policy (features.failures) with extraction, not its driver.
APART = {"tvrpipe.search": {"tvrpipe.training"}, "tvrpipe.training": {"tvrpipe.features.extract"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage(module: str) -> str:
    """The entry of LAYERS a module belongs to: its longest prefix there."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} belongs to no stage of LAYERS; add its folder there")


def tvrpipe_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) of every tvrpipe import, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] == "tvrpipe":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "tvrpipe"]
    return sorted(found)


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_stage():
    assert MODULES
    for path in MODULES:
        stage(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_go_down_the_stack_and_no_private_name_crosses_a_module(path: Path):
    me = module_name(path)
    for line, target, names in tvrpipe_imports(path):
        where = f"{path.relative_to(PACKAGE.parent)}:{line}"
        if stage(target) != stage(me):
            assert LAYERS[stage(target)] <= LAYERS[stage(me)], (
                f"{where}: {me} imports {target}, a stage above it")
            assert not any(target == p or target.startswith(p + ".") for p in APART.get(stage(me), ())), (
                f"{where}: {me} imports {target}")
        # `from tvrpipe.x import y` may name a submodule y; its own module is then tvrpipe.x.y
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        assert not private or target == me, f"{where}: imports private {', '.join(private)} from {target}"


def test_the_checks_fail_on_a_private_import_and_on_an_upward_import(tmp_path):
    """The rules above can fail: the scanner sees a lazy private import and an upward one."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tvrpipe.training.fit import _read_config\n"
                   "import tvrpipe.cli.app\n")
    found = tvrpipe_imports(bad)
    assert found == [(2, "tvrpipe.training.fit", ["_read_config"]), (3, "tvrpipe.cli.app", [])]
    assert LAYERS[stage("tvrpipe.cli.app")] > LAYERS[stage("tvrpipe.heads.base")]


def test_pyproject_lists_every_package_and_ships_the_specs_and_recipes():
    """A wheel holds what pyproject lists: every folder of the package with an __init__.py, and the dataset
    specs (manifests/) and recipes (recipes/) mapped into it, which automatic discovery would miss."""
    import tomllib

    setup = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert set(setup["packages"]) == folders | {"tvrpipe._specs", "tvrpipe._recipes"}
    assert setup["package-dir"] == {"tvrpipe._specs": "manifests", "tvrpipe._recipes": "recipes"}
    assert setup["package-data"]["tvrpipe._specs"] == ["*.yaml"] == setup["package-data"]["tvrpipe._recipes"]


# the one home of renames into place: a write staged under a temporary name and renamed (files.py)
RENAME_HOME = PACKAGE / "files.py"


def renames(path: Path) -> list[int]:
    """Lines of ``path`` that rename a file or folder: ``os.replace`` / ``os.rename`` / ``shutil.move``, or a
    path's ``.rename(x)`` / ``.replace(x)`` (one argument: ``str.replace`` takes two)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        if (owner, f.attr) in {("os", "replace"), ("os", "rename"), ("shutil", "move")} or (
                owner not in ("os", "shutil") and f.attr in ("rename", "replace") and len(node.args) == 1
                and not node.keywords):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("path", [p for p in MODULES if p != RENAME_HOME], ids=lambda p: module_name(p))
def test_no_rename_into_place_outside_files(path: Path):
    """Every temp-then-rename write goes through files.py (atomic_write, atomic_write_all, atomic_replace_folder,
    move_into_place), so staged names and their cleanup are the same everywhere."""
    assert renames(path) == [], f"{module_name(path)} renames at lines {renames(path)}: use tvrpipe.files"


def test_the_rename_check_finds_renames_and_leaves_str_replace(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os, shutil\nos.replace(a, b)\nx.rename(y)\np.replace(q)\nshutil.move(a, b)\n"
                   "s = 'a'.replace('a', 'b')\nt = s.replace(old, new)\n")
    assert renames(src) == [2, 3, 4, 5]
    assert renames(RENAME_HOME)  # files.py does rename: the check can see it
