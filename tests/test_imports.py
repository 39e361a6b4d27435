"""The import graph: every module imports on its own in a fresh interpreter; no import (module-level or lazy)
closes a cycle, in the package or in bench/; no folder imports one above it in the order the package docstring
declares; config is a leaf; no file names the old `recipe` package."""
import ast
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO

import grpo_recipe
from grpo_recipe.dist.env import rank_env

PKG = "grpo_recipe"


def modules_under(folder, prefix=""):
    return sorted((prefix + ".".join(p.relative_to(folder).with_suffix("").parts)).removesuffix(".__init__")
                  for p in folder.rglob("*.py"))


MODULES = modules_under(REPO / PKG, PKG + ".")
BENCH = modules_under(REPO / "bench")


def source(module: str, root) -> str:
    path = root / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = root / module.replace(".", "/") / "__init__.py"
    return path.read_text()


def imports(module: str, known: list[str], root) -> set[str]:
    """The modules of `known` that `module` imports anywhere in its file (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(source(module, root))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` names a module; `from pkg.x import f` names x
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= (subs & set(known)) or {node.module}
    return {m for m in found if m in known and m != module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, path = set(), []

    def visit(m):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph[m]):
            cycle = visit(n)
            if cycle:
                return cycle
        path.pop()
        done.add(m)
        return None

    for m in graph:
        cycle = visit(m)
        if cycle:
            return cycle
    return None


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "train"


@pytest.mark.parametrize("names,root", [(MODULES, REPO), (BENCH, REPO / "bench")], ids=["package", "bench"])
def test_import_graph_has_no_cycle(names, root):
    graph = {m: imports(m, names, root) for m in names}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_folder_imports_one_above_it():
    order = {name: i for i, name in enumerate(grpo_recipe.LAYERS)}
    assert set(order) == {layer(m) for m in MODULES if m != PKG}, "every folder has its place in LAYERS"
    doc = grpo_recipe.__doc__
    assert sorted(grpo_recipe.LAYERS, key=lambda n: doc.index(f"\n    {n} ")) == list(grpo_recipe.LAYERS)
    upward = []
    for m in MODULES:
        if m == PKG:
            continue
        for n in imports(m, MODULES, REPO):
            if n == PKG:
                continue
            a, b = layer(m), layer(n)
            if a == b:
                continue
            if order[b] > order[a] or (a in grpo_recipe.TOP and b in grpo_recipe.TOP):
                upward.append(f"{m} -> {n}")
    assert not upward, "imports that go up the declared order:\n" + "\n".join(upward)


def test_config_is_a_leaf_and_algo_does_not_import_deepspeed():
    for m in MODULES:
        if layer(m) == "config":
            assert {layer(n) for n in imports(m, MODULES, REPO) if n != PKG} <= {"config"}, m
        if layer(m) == "algo":
            tree = ast.parse(source(m, REPO))
            names = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
            names |= {node.module.split(".")[0] for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.module}
            assert "deepspeed" not in names, f"{m} imports deepspeed"


def test_no_file_names_the_old_package():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    # where the old names are named on purpose: the table that maps them to the new ones, and its tests
    on_purpose = {"tests/test_imports.py", "tests/test_config_load.py", "grpo_recipe/config/load.py"}
    pattern = re.compile(r"(?<![\w/.-])(?:(?:from|import) recipe\b|recipe\.[a-z_]+|recipe/(?:configs|data|examples)/)")
    old = []
    for rel in tracked:
        if not rel.endswith((".py", ".sh", ".yaml", ".toml", ".sbatch", ".md")) or rel in on_purpose:
            continue
        old += [f"{rel}: {m.group(0)!r}" for m in pattern.finditer((REPO / rel).read_text())]
    assert not old, "\n".join(old)


def test_each_module_imports_alone_and_config_pulls_in_nothing_else():
    code = "import importlib, sys; importlib.import_module(sys.argv[1]); " \
           f"print(sorted(m for m in sys.modules if m.split('.')[0] == {PKG!r}))"

    def fresh(m):
        return subprocess.run([sys.executable, "-c", code, m], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(4) as pool:  # a few interpreters at a time: each one imports torch
        procs = dict(zip(MODULES, pool.map(fresh, MODULES)))
    for m, proc in procs.items():
        assert proc.returncode == 0, f"import {m} alone failed:\n{proc.stderr[-2000:]}"
    assert procs[f"{PKG}.config.schema"].stdout.split() == [f"['{PKG}',", f"'{PKG}.config',", f"'{PKG}.config.schema']"]
    # launchers read the exit codes before anything heavy
    assert "torch" not in subprocess.run([sys.executable, "-c", f"import sys, {PKG}.dist.env; print(list(sys.modules))"],
                                         cwd=REPO, env=rank_env(), capture_output=True, text=True).stdout
