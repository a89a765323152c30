"""megatron_ext's modules import each other without a circle.

Every import of every module counts, those inside functions included (a circle that only
closes at call time still ties the modules together): relative imports are resolved, and
``from pkg import name`` is an import of ``pkg.name`` when that is a module. A package's
``__init__`` running before its modules is not counted as an import of it.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_ext"


def module_names(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of ``package`` (a package by its __init__)."""
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its file."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    imported = set()
    for target in found:
        while target and target not in modules:  # megatron_ext.a.b.Name -> megatron_ext.a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            imported.add(target)
    return imported


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _edges_within(graph: dict[str, set[str]], circle: list[str]) -> list[str]:
    return [f"{a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle]


def test_no_import_circle():
    graph = import_graph()
    # The registry's machinery imports nothing of the product but the root error class, which
    # itself imports nothing.
    assert "megatron_ext.registry" in graph
    assert graph["megatron_ext.registry"] <= {"megatron_ext.errors"}
    assert graph.get("megatron_ext.errors", set()) == set()
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(
        "  " + "; ".join(_edges_within(graph, c)) for c in found
    )


def test_a_planted_circle_is_found(tmp_path):
    """Function-level, relative and ``from pkg import module`` imports all close a circle."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import c\n")
    (package / "sub" / "c.py").write_text("from ..a import f\n")
    (package / "d.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]


# ---- the shape of the house: which package may import which ------------------------------------
def _package(module: str) -> str:
    """The top-level package (or module) of megatron_ext that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _arrows(graph: dict[str, set[str]], source: str, target: str) -> set[str]:
    return {
        f"{a} -> {b}"
        for a, imported in graph.items()
        if _package(a) == source
        for b in imported
        if _package(b) == target
    }


# runs/ starts from what recipes/ hands it: the schema and the run request (issue 35). No arrow
# into the rest of recipes/ is left; a new one fails.
RUNS_INTO_RECIPES_TODAY: set[str] = set()
RUNS_MAY_IMPORT = {"megatron_ext.recipes.schema", "megatron_ext.recipes.request"}


def test_recipes_never_imports_runs():
    assert not _arrows(import_graph(), "recipes", "runs")


def test_runs_imports_recipes_only_through_the_request_and_the_schema():
    arrows = _arrows(import_graph(), "runs", "recipes")
    others = {a for a in arrows if a.split(" -> ")[1] not in RUNS_MAY_IMPORT}
    assert others <= RUNS_INTO_RECIPES_TODAY, f"new: {sorted(others - RUNS_INTO_RECIPES_TODAY)}"
    assert others == RUNS_INTO_RECIPES_TODAY, (
        f"gone (strike them from RUNS_INTO_RECIPES_TODAY): {sorted(RUNS_INTO_RECIPES_TODAY - others)}"
    )


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which top-level package (or module) of megatron_ext imports which other one."""
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(_package(module), set())
        for target in imported:
            if _package(target) != _package(module):
                packages[_package(module)].add(_package(target))
                packages.setdefault(_package(target), set())
    return packages


def test_no_two_packages_lean_on_each_other():
    """The packages stand on floors: none imports, even through others, a package that imports
    it back (the modules may be a tree inside, the packages still lean on each other)."""
    packages = package_graph(import_graph())
    found = circles(packages)
    assert not found, "package circles:\n" + "\n".join(
        "  " + "; ".join(_edges_within(packages, c)) for c in found
    )


def test_schedules_imports_no_recipes_runs_multimodule_or_pipeline():
    """schedules/ is the schedule as data; the pipeline that runs it stands on it."""
    graph = import_graph()
    for above in ("recipes", "runs", "multimodule", "pipeline"):
        assert not _arrows(graph, "schedules", above), above


def test_launch_knows_no_recipe():
    """launch/ starts processes from what it is handed (a node layout's grids included): it
    imports no recipes/, runs/ or cli/."""
    graph = import_graph()
    for above in ("recipes", "runs", "cli"):
        assert not _arrows(graph, "launch", above), above


def test_upstream_cases_stand_below_the_recipes():
    """The recipe loader reads a Megatron-LM test case through upstream_cases/, which imports
    nothing of recipes/ (its flag tables are recipe_flags.py, the schema's defaults are handed in)."""
    assert not _arrows(import_graph(), "upstream_cases", "recipes")


def test_mhc_never_imports_guards():
    assert not _arrows(import_graph(), "mhc", "guards")


def test_no_package_holds_more_than_15_percent_of_the_lines():
    lines: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        lines[top] = lines.get(top, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    heavy = {name: f"{n / total:.1%}" for name, n in lines.items() if n > 0.15 * total}
    assert not heavy, f"packages above 15 % of megatron_ext's {total} lines: {heavy}"


def test_a_planted_package_circle_is_found(tmp_path):
    """Two packages whose modules form no circle still lean on each other (a.x -> b.y, b.z ->
    a.w): the package rule sees it."""
    package = tmp_path / "megatron_ext"
    for sub in ("a", "b"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a" / "x.py").write_text("from megatron_ext.b import y\n")
    (package / "b" / "y.py").write_text("")
    (package / "b" / "z.py").write_text("def f():\n    from megatron_ext.a import w\n")
    (package / "a" / "w.py").write_text("")
    graph = import_graph(package)
    assert circles(graph) == []
    assert circles(package_graph(graph)) == [["a", "b"]]


def test_the_shape_rules_can_fail(tmp_path):
    """A planted arrow from recipes/ into runs/ is seen by the rules' reader."""
    package = tmp_path / "megatron_ext"
    for sub in ("recipes", "runs"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "recipes" / "a.py").write_text("def f():\n    from megatron_ext.runs import b\n")
    (package / "runs" / "b.py").write_text("")
    assert _arrows(import_graph(package), "recipes", "runs") == {
        "megatron_ext.recipes.a -> megatron_ext.runs.b"
    }
