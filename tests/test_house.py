"""The packages' layout: no import circles, small modules, one-way dependencies.

Reads the source with `ast` only (nothing is imported), so it is fast. Imports inside
functions count: a circle closed by a deferred import is still a circle to a reader.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("mpfunc", "mpfunc_torch", "_mpfunc_common")
MAX_LINES = 420


def _modules():
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            mods[name] = path
    return mods


def _imports(name, path, mods):
    """Every module of the three packages that `name` imports, at any depth in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for i in range(len(parts), 0, -1):
                    if ".".join(parts[:i]) in mods:
                        found.add(".".join(parts[:i]))
                        break
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                if path.name != "__init__.py":
                    parts = parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            if base in mods:
                found.add(base)
            for alias in node.names:
                if f"{base}.{alias.name}" in mods:
                    found.add(f"{base}.{alias.name}")
    found.discard(name)
    return found


def _graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _circles(edges):
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circles():
    assert _circles(_graph()) == []


def test_circle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]


def test_modules_are_small():
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert too_long == {}


def test_dependencies_point_one_way():
    edges = _graph()
    crossing = sorted(
        (name, dep)
        for name, deps in edges.items()
        for dep in deps
        if (name.startswith("_mpfunc_common") and not dep.startswith("_mpfunc_common"))
        or (name.split(".")[0] == "mpfunc" and dep.split(".")[0] == "mpfunc_torch")
        or (name.split(".")[0] == "mpfunc_torch" and dep.split(".")[0] == "mpfunc")
    )
    assert crossing == []


def test_every_package_is_in_the_wheel():
    # pyproject lists the packages explicitly: a new subpackage missing there would be
    # left out of the wheel while every test from the checkout still passes.
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]
    found = sorted(
        ".".join(init.parent.relative_to(ROOT).parts)
        for pkg in PACKAGES
        for init in (ROOT / pkg).rglob("__init__.py")
    )
    assert sorted(listed) == found
