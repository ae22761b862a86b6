"""The house rules the layout keeps, checked on the tree: the hook's folder imports nothing of the
daemon's, no module imports itself back through others, no two modules share a name, no module
outgrows a reading, and the prose speaks of the software (no development history)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from conftest import ROOT

PACKAGE_FOLDERS = ("common", "plan", "vfs", "reader", "loader", "mount")
DAEMON_FOLDERS = ("vfs", "reader", "mount")


def _modules() -> dict[str, Path]:
    """rankfs.* module name -> its file, for the installed package's folders."""
    found = {"rankfs": ROOT / "__init__.py"}
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("rankfs",) + (parts[:-1] if parts[-1] == "__init__" else parts))
            found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The rankfs modules a file imports, anywhere in it but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for stmt in ast.walk(tree) if isinstance(stmt, ast.If)
               and getattr(stmt.test, "id", "") == "TYPE_CHECKING" for node in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:  # a module of a package, or a name of a module
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        out |= {name for name in names if name in modules and name != "rankfs"}
    return out


def test_no_module_imports_itself_back():
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    done, cycles = set(), []

    def visit(name, stack):
        if name in stack:
            cycles.append(stack[stack.index(name):] + [name])
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, stack + [name])
        done.add(name)
    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


def test_the_hooks_folder_imports_nothing_of_the_daemons():
    modules = _modules()
    hook = {name for name in modules if name.startswith("rankfs.loader")}
    reached = {imported for name in hook for imported in _imports(modules[name], modules)}
    assert not {name for name in reached if name.split(".")[1] in DAEMON_FOLDERS}


def test_no_two_modules_share_a_name_and_none_outgrows_a_reading():
    files = [Path(p) for p in subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                                             text=True, check=True).stdout.split()]
    names = [p.name for p in files if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    long = [str(p) for p in files if p.parts[0] != "tests" and len((ROOT / p).read_text().splitlines()) > 450]
    assert long == []


def test_the_prose_speaks_of_the_software():
    """No development history outside the tests: no session numbers, no machine diaries."""
    found = subprocess.run(["git", "grep", "-n", "-i", "-E", r"(th|st|nd|rd|this|last|next|earlier) sessions?",
                            "--", ".", ":!tests"], cwd=ROOT, capture_output=True, text=True).stdout
    assert found == ""
    package = [ROOT / folder for folder in PACKAGE_FOLDERS]
    diaries = [f"{path}:{i}" for folder in package for path in folder.rglob("*.py")
               for i, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"2-core VM|H200 host|\bVMs?\b", line)]
    assert diaries == []
