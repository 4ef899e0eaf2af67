"""The import graph keeps DESIGN.md's rooms and walls: no cycle between packages, tiers import only the common
rooms and their own, and torch stays out of shared, api, tokenizer and scheduler (read with `ast`, nothing run)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("services.api", "services.tokenizer", "services.scheduler", "services.worker")
COMMON = ("shared", "services.protocol", "services.grammar")  # what every tier may import
EXTRA = {"services.worker": ("kernels",)}  # the layer below the worker
# Rooms other than the tiers, and what each may import besides itself.
LIBRARIES = {"shared": (), "kernels": ("shared",), "services.protocol": ("shared",), "services.grammar": ("shared",),
             "services": ()}
HEAVY = ("torch", "triton")
NO_TORCH = ("shared", "services.api", "services.tokenizer", "services.scheduler")
PURE = ("pagoda.services.scheduler.scheduler", "pagoda.services.scheduler.block_manager")  # no zmq, no torch


@dataclass(slots=True)
class Module:
    name: str
    is_package: bool
    imports: set[str] = field(default_factory=set)  # every import, also inside functions and TYPE_CHECKING
    runtime: set[str] = field(default_factory=set)  # run when called: TYPE_CHECKING blocks left out
    top: set[str] = field(default_factory=set)  # run when the module is imported (module level, not TYPE_CHECKING)


def source_files() -> Iterator[tuple[str, Path]]:
    """(module name, file) for every module the package-dir table of pyproject.toml maps."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs: dict[str, str] = config["package-dir"]
    for package in config["packages"]:
        base = max((p for p in package_dirs if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / package_dirs[base] / package[len(base) + 1:].replace(".", "/")
        for path in sorted(folder.glob("*.py")):
            yield (package if path.stem == "__init__" else f"{package}.{path.stem}"), path


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, module: Module, *, typing_only: bool, nested: bool) -> None:
    for child in ast.iter_child_nodes(node):
        names: list[str] = []
        if isinstance(child, ast.Import):
            names = [alias.name for alias in child.names]
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module is not None:
            names = [child.module] + [f"{child.module}.{alias.name}" for alias in child.names]
        for name in names:
            module.imports.add(name)
            if not typing_only:
                module.runtime.add(name)
                if not nested:
                    module.top.add(name)
        is_def = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        _walk(child, module, typing_only=typing_only or (isinstance(child, ast.If) and _is_type_checking(child)),
              nested=nested or is_def)


def parse_tree() -> dict[str, Module]:
    modules = {}
    for name, path in source_files():
        module = Module(name, path.name == "__init__.py")
        _walk(ast.parse(path.read_text(), str(path)), module, typing_only=False, nested=False)
        modules[name] = module
    return modules


def resolve(name: str, modules: dict[str, Module]) -> str:
    """A pagoda module an import names (its longest known prefix: `from pagoda.x import y` names pagoda.x.y when
    that is a module, else pagoda.x), or the top-level name of a third-party one."""
    if not name.startswith("pagoda"):
        return name.split(".")[0]
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def room(name: str, modules: dict[str, Module]) -> str:
    """The package a module lives in: `services.api`, `shared`, ...; a module of the top `pagoda` package is a room
    of its own (`pagoda.cli`), and so is the `pagoda` package itself."""
    parts = name.split(".")

    def is_package(n: int) -> bool:
        module = modules.get(".".join(parts[:n]))
        return module is not None and module.is_package

    if parts[:2] == ["pagoda", "services"] and len(parts) > 2 and is_package(3):
        return ".".join(parts[1:3])
    if len(parts) > 1 and is_package(2):
        return parts[1]
    return name


def pagoda_edges(modules: dict[str, Module], attr: str = "imports") -> dict[str, set[str]]:
    return {name: {target for imported in getattr(module, attr)
                   if (target := resolve(imported, modules)).startswith("pagoda") and target != name}
            for name, module in modules.items()}


def room_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected groups of more than one room (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for name, targets in pagoda_edges(modules).items():
        graph.setdefault(room(name, modules), set()).update(room(t, modules) for t in targets)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def wall_crossings(modules: dict[str, Module]) -> list[str]:
    """Imports from a tier or a library room into a room it may not import."""
    out = []
    for name, targets in pagoda_edges(modules).items():
        source = room(name, modules)
        if source in TIERS:
            allowed = {source, *COMMON, *EXTRA.get(source, ())}
        elif source in LIBRARIES:
            allowed = {source, *LIBRARIES[source]}
        else:
            continue  # the composing modules (pagoda.engine, pagoda.launcher, pagoda.cli, ...) and bench
        out += [f"{name} -> {target}" for target in sorted(targets) if room(target, modules) not in allowed]
    return out


def _parents(name: str) -> Iterable[str]:
    parts = name.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts)))


def heavy_imports(start: str, modules: dict[str, Module], heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """Chains `start -> ... -> module -> torch` that importing `start` (and calling into it) can run. A parent
    package's __init__ runs too, with its module-level imports only."""
    edges = {"runtime": pagoda_edges(modules, "runtime"), "top": pagoda_edges(modules, "top")}
    queue: list[tuple[str, str, list[str]]] = [(start, "runtime", [start])]
    seen: set[tuple[str, str]] = set()
    found: set[str] = set()
    while queue:
        name, kind, path = queue.pop()
        if (name, kind) in seen or (name, "runtime") in seen:
            continue
        seen.add((name, kind))
        imported = {resolve(i, modules) for i in getattr(modules[name], kind)}
        found.update(" -> ".join([*path, h]) for h in heavy if h in imported)
        queue += [(target, "runtime", [*path, target]) for target in edges[kind][name]]
        queue += [(parent, "top", [*path, parent]) for parent in _parents(name) if parent in modules]
    return sorted(found)


@pytest.fixture(scope="module")
def tree() -> dict[str, Module]:
    return parse_tree()


def test_the_tree_is_read(tree: dict[str, Module]) -> None:
    """The walk finds the tiers and their imports (a broken walk would pass every check below)."""
    for tier in TIERS:
        assert any(room(name, tree) == tier for name in tree), tier
    assert "pagoda.shared.messages" in pagoda_edges(tree)["pagoda.services.scheduler.service"]
    assert "torch" in {resolve(i, tree) for i in tree["pagoda.services.worker.models.base"].runtime}


def test_no_cycle_between_packages(tree: dict[str, Module]) -> None:
    assert room_cycles(tree) == []


def test_tiers_import_only_the_common_rooms(tree: dict[str, Module]) -> None:
    assert wall_crossings(tree) == []


@pytest.mark.parametrize("package", NO_TORCH)
def test_no_torch_through_pagoda_modules(tree: dict[str, Module], package: str) -> None:
    chains = [chain for name in tree if room(name, tree) == package for chain in heavy_imports(name, tree)]
    assert chains == []


@pytest.mark.parametrize("name", PURE)
def test_scheduler_policy_is_pure(tree: dict[str, Module], name: str) -> None:
    assert heavy_imports(name, tree, ("torch", "zmq")) == []


def test_checks_catch_a_cycle_a_crossing_and_torch() -> None:
    """The checks on a made-up tree that breaks each rule once."""
    fake = {name: Module(name, is_package) for name, is_package in (
        ("pagoda", True), ("pagoda.services", True), ("pagoda.services.api", True),
        ("pagoda.services.api.app", False), ("pagoda.services.tokenizer", True),
        ("pagoda.services.tokenizer.tools", False), ("pagoda.shared", True), ("pagoda.shared.config", False))}
    fake["pagoda.services.api.app"].imports = fake["pagoda.services.api.app"].runtime = {
        "pagoda.services.tokenizer.tools"}
    fake["pagoda.services.tokenizer.tools"].imports = fake["pagoda.services.tokenizer.tools"].runtime = {
        "pagoda.services.api.app", "pagoda.shared.config"}
    fake["pagoda.shared"].imports = fake["pagoda.shared"].runtime = fake["pagoda.shared"].top = {"torch.nn"}
    assert room_cycles(fake) == [["services.api", "services.tokenizer"]]
    assert wall_crossings(fake) == ["pagoda.services.api.app -> pagoda.services.tokenizer.tools",
                                    "pagoda.services.tokenizer.tools -> pagoda.services.api.app"]
    assert heavy_imports("pagoda.services.api.app", fake) == [
        "pagoda.services.api.app -> pagoda.services.tokenizer.tools -> pagoda.shared.config -> pagoda.shared"
        " -> torch"]


def environment_reads(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line NAME' for each os.environ.get / os.getenv / os.environ[...] of a string constant in the file."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        key: ast.AST | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = ast.unparse(node.func.value)
            if (owner == "os.environ" and node.func.attr == "get") or (owner == "os" and node.func.attr == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append(f"{path.relative_to(root)}:{node.lineno} {key.value}")
    return found


def test_only_the_config_module_reads_pagoda_variables() -> None:
    """DESIGN.md: one config module reads the environment. PAGODA_* settings and measurement switches, and whether
    Triton runs interpreted, are read through pagoda.shared.config everywhere else."""
    config = (ROOT / "shared" / "config.py").resolve()
    reads = [read for name, path in source_files() if path.resolve() != config and not name.startswith("pagoda.bench")
             for read in environment_reads(path)]  # bench/: measuring tools, outside the rooms
    assert [r for r in reads if r.split()[-1].startswith("PAGODA_") or r.split()[-1] == "TRITON_INTERPRET"] == []


def test_environment_reads_are_found(tmp_path: Path) -> None:
    """The scan above sees each way of reading a variable (a blind scan would pass)."""
    (tmp_path / "m.py").write_text('import os\na = os.environ.get("PAGODA_X")\nb = os.getenv("PAGODA_Y", "1")\n'
                                   'c = os.environ["TRITON_INTERPRET"]\nd = os.environ.get(name)\n')
    reads = [r.split(":", 1)[1] for r in environment_reads(tmp_path / "m.py", tmp_path)]
    assert reads == ["2 PAGODA_X", "3 PAGODA_Y", "4 TRITON_INTERPRET"]


def test_the_api_and_scheduler_load_no_torch() -> None:
    """What the static checks say, seen in a real import (third-party packages included)."""
    code = ("import sys; import pagoda.shared.config, pagoda.shared.shapes, pagoda.shared.transport; "
            "import pagoda.services.api.__main__, pagoda.services.scheduler.service; "
            "bad = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tokenizer_process_loads_no_torch(smollm2_dir: Path) -> None:
    """A tokenizer process's imports, its tokenizer and llguidance's view of it: no torch, and no trick hiding it
    (transformers imports torch for its auto classes; the tokenizer class a folder names is imported alone)."""
    code = ("import sys; import pagoda.services.tokenizer.__main__; "
            "from pagoda.services.tokenizer.tokenizer import Tokenizer; "
            "from pagoda.services.grammar.compiler import LazyGrammarChecker; "
            f"tokenizer = Tokenizer({str(smollm2_dir)!r}); LazyGrammarChecker(tokenizer); "
            "assert tokenizer.encode('hello') and sys.modules.get('torch', 0) is not None; "
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("named", "expected"), [("Qwen2TokenizerFast", "Qwen2Tokenizer"),
                                                 ("TokenizersBackend", "TokenizersBackend"),
                                                 ("AutoModelForCausalLM", "AutoTokenizer"),  # not a tokenizer
                                                 ("os.system", "AutoTokenizer"), (None, "AutoTokenizer")])
def test_tokenizer_class_is_the_one_the_folder_names(tmp_path: Path, named: str | None, expected: str) -> None:
    import json

    from pagoda.shared.hf_tokenizer import tokenizer_class

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": named} if named else {}))
    assert tokenizer_class(tmp_path).__name__ == expected
