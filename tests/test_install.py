"""What each install gives a user: the extras, and the imports that work without the others.

The base install is framework-free; `mpfunc[jax]`, `mpfunc[flax]` and `mpfunc[torch]` bring
one framework each (see pyproject.toml and README, "Install"). These tests prove it without
building extra environments: a subprocess hides packages behind an import hook that raises
``ModuleNotFoundError: No module named ...`` exactly as a missing install does, and the
declared extras are read from pyproject.toml and walked through the installed packages'
own metadata.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Put first in the child: every module whose top-level name is in `HIDDEN` (comma-separated
# in the environment) is "not installed".
_HIDE = textwrap.dedent("""
    import os, sys

    class _NotInstalled:
        hidden = set(filter(None, os.environ["HIDDEN"].split(",")))

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.hidden:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
""")

JAX_SIDE = "jax,jaxlib,optax,chex,flax,orbax,tensorstore"
TORCH_SIDE = "torch,torchvision,functorch"
FLAX_SIDE = "flax,orbax,tensorstore"


def run_without(hidden: str, *code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HIDDEN=hidden)
    env.pop("XLA_FLAGS", None)
    program = _HIDE + "".join(textwrap.dedent(part) for part in code)
    return subprocess.run([sys.executable, "-c", program],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def loaded_check(prefixes: str) -> str:
    return textwrap.dedent(f"""
        bad = sorted(m for m in sys.modules if m.partition(".")[0] in {set(prefixes.split(","))!r})
        assert not bad, f"loaded {{bad}}"
    """)


# ------------------------------------------------------------------ imports without the rest
def test_the_hook_hides_a_package_like_a_missing_install():
    # The hook itself must work, or every test below would pass vacuously.
    out = run_without("json", "import json")
    assert out.returncode != 0
    assert "ModuleNotFoundError: No module named 'json'" in out.stderr


def test_mpfunc_torch_trains_without_jax_or_flax():
    out = run_without(JAX_SIDE, """
        import torch, mpfunc_torch
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        model, opt, crit = mpfunc_torch.convert_to_amp(
            net, torch.optim.SGD(net.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(),
            mode="naive", initial_scale=2.0**8)
        before = [p.detach().clone() for p in net.parameters()]
        for _ in range(3):
            opt.zero_grad()
            loss = crit(model(torch.randn(16, 4)), torch.randint(0, 3, (16,)))
            opt.backward(loss)
            opt.step()
        assert net[0].weight.dtype == torch.float16, net[0].weight.dtype
        m = opt.scale_metrics(as_python=True)
        assert m["skipped_steps"] == 0 and m["loss_scale"] == 256.0, m
        assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
    """, loaded_check(JAX_SIDE), "print('ok')")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_mpfunc_trains_without_torch_or_flax():
    out = run_without(TORCH_SIDE + "," + FLAX_SIDE, """
        import jax, jax.numpy as jnp, optax, mpfunc
        amp = mpfunc.convert_to_amp(lambda p, x: x @ p["w"], optax.sgd(0.1), mode="naive")
        params = amp.cast_params({"w": jnp.ones((4, 2), jnp.float32)})
        state = amp.optimizer.init(params)

        @jax.jit
        def step(params, state, x):
            def loss_fn(p):
                return mpfunc.scale_loss(jnp.mean(amp.apply_fn(p, x) ** 2), state)
            updates, state = amp.optimizer.update(jax.grad(loss_fn)(params), state, params)
            return optax.apply_updates(params, updates), state

        new, state = step(params, state, jnp.ones((3, 4), jnp.float32))
        assert new["w"].dtype == jnp.float16
        assert not bool(jnp.array_equal(new["w"], params["w"])) or int(state.skipped_steps) == 1
    """, loaded_check(TORCH_SIDE + "," + FLAX_SIDE), "print('ok')")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("missing", ["jax", "optax"])
def test_import_mpfunc_without_jax_names_the_extra(missing):
    out = run_without(missing, """
        try:
            import mpfunc
        except ModuleNotFoundError as e:
            print(e.name); print(e)
        else:
            raise SystemExit("imported")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    name, message = out.stdout.split("\n", 1)
    assert name == missing
    assert "pip install 'mpfunc[jax]'" in message
    assert f"{missing!r} could not be imported" in message
    assert "mpfunc_torch" in message  # points a torch user at the torch package


def test_import_mpfunc_torch_without_torch_names_the_extra():
    out = run_without("torch", """
        try:
            import mpfunc_torch
        except ModuleNotFoundError as e:
            print(e.name); print(e)
        else:
            raise SystemExit("imported")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    name, message = out.stdout.split("\n", 1)
    assert name == "torch"
    assert "pip install 'mpfunc[torch]'" in message


TRAINERS = "pytorch_lightning,lightning,lightning_fabric,transformers,accelerate"


@pytest.mark.slow  # imports every trainer stack in children, about 12 s; test_public_api's no-other-framework checks stay
def test_import_mpfunc_torch_loads_no_trainer():
    # The trainers are imported only by their own modules, when asked for.
    out = run_without("", "import sys\nimport mpfunc_torch\n", loaded_check(TRAINERS),
                      "import mpfunc_torch.lightning\n",
                      "assert 'pytorch_lightning' in sys.modules\n", "print('ok')")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("module, hidden, extra", [
    ("mpfunc_torch.lightning", "pytorch_lightning,lightning", "lightning"),
    ("mpfunc_torch.transformers", "transformers", "hf"),
    ("mpfunc_torch.transformers", "accelerate", "hf"),
])
def test_a_trainer_module_without_its_packages_names_the_extra(module, hidden, extra):
    out = run_without(hidden, f"""
        import mpfunc_torch
        try:
            import {module}
        except ModuleNotFoundError as e:
            print(e.name); print(e)
        else:
            raise SystemExit("imported")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    name, message = out.stdout.split("\n", 1)
    assert name in hidden.split(",")
    assert f"needs the `{extra}` extra" in message
    assert f"pip install 'mpfunc[{extra}]'" in message


def test_flax_helpers_without_flax_name_the_extra():
    out = run_without(FLAX_SIDE, """
        import mpfunc
        calls = {
            "norm_classes": lambda: mpfunc.norm_classes("linen"),
            "linen_policy": lambda: mpfunc.linen_policy(object(), "mixed_f16"),
            "nnx_apply_policy": lambda: mpfunc.nnx_apply_policy(object(), "mixed_f16"),
        }
        for fn, call in calls.items():
            try:
                call()
            except ModuleNotFoundError as e:
                assert e.name == "flax", e.name
                assert f"mpfunc.{fn} needs the `flax` extra" in str(e), str(e)
                assert "pip install 'mpfunc[flax]'" in str(e), str(e)
            else:
                raise SystemExit(f"{fn} ran without flax")
        print("ok")
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------------ declared extras
def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")


def _expanded(extra: str, project: dict) -> list[str]:
    """An extra's requirements, with ``mpfunc[...]`` self-references expanded."""
    out = []
    for req in project["optional-dependencies"][extra]:
        if _name(req) == project["name"]:
            inner = re.search(r"\[(.*)\]", req).group(1)
            for e in inner.split(","):
                out += _expanded(e.strip(), project)
        else:
            out.append(req)
    return out


def test_declared_extras_keep_the_frameworks_apart():
    project = _pyproject()
    base = {_name(r) for r in project["dependencies"]}
    extras = {e: {_name(r) for r in _expanded(e, project)} | base
              for e in project["optional-dependencies"]}
    assert base == {"numpy"}
    assert {"jax", "optax"} <= extras["jax"] and not extras["jax"] & {"flax", "torch"}
    assert "flax" in extras["flax"] and {"jax", "optax"} <= extras["flax"]
    assert "torch" not in extras["flax"]
    assert "torch" in extras["torch"]
    assert not extras["torch"] & {"jax", "jaxlib", "optax", "chex", "flax"}
    for cuda in ("cuda12", "cuda13"):
        assert {"jax", "optax"} <= extras[cuda] and not extras[cuda] & {"flax", "torch"}
    # dev installs everything the test suite imports.
    assert {"jax", "optax", "flax", "torch", "pytest", "hypothesis", "chex",
            "transformers", "jmp", "dm-haiku", "pytorch-lightning", "lightning",
            "accelerate"} <= extras["dev"]
    # The trainer extras bring their trainer and torch, and no JAX.
    assert {"torch", "pytorch-lightning"} <= extras["lightning"]
    assert {"torch", "transformers", "accelerate"} <= extras["hf"]
    for trainers in ("lightning", "hf"):
        assert not extras[trainers] & {"jax", "jaxlib", "optax", "chex", "flax"}


def _closure(requirements: list[str]) -> tuple[set[str], set[str]]:
    """Installed distributions reachable from ``requirements`` through their metadata."""
    packaging_requirements = pytest.importorskip("packaging.requirements")
    seen, missing = set(), set()
    todo = [(packaging_requirements.Requirement(r), ()) for r in requirements]
    done: set[tuple[str, tuple]] = set()
    while todo:
        req, _ = todo.pop()
        name = req.name.lower().replace("_", "-")
        key = (name, tuple(sorted(req.extras)))
        if key in done:
            continue
        done.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.add(name)
            continue
        seen.add(name)
        for sub in dist.requires or []:
            r = packaging_requirements.Requirement(sub)
            envs = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if r.marker is None or any(r.marker.evaluate(env) for env in envs):
                todo.append((r, ()))
    return seen, missing


@pytest.mark.parametrize("extra, forbidden", [
    ("torch", {"jax", "jaxlib", "optax", "chex", "flax", "orbax-checkpoint", "tensorstore"}),
    ("jax", {"flax", "orbax-checkpoint", "tensorstore", "torch"}),
    ("flax", {"torch"}),
    ("lightning", {"jax", "jaxlib", "optax", "chex", "flax"}),
    ("hf", {"jax", "jaxlib", "optax", "chex", "flax"}),
])
def test_installed_dependency_closure_of_each_extra(extra, forbidden):
    # Walks the real packages' own Requires-Dist, so a framework that comes in through a
    # dependency of a dependency is caught too.
    project = _pyproject()
    reqs = list(project["dependencies"]) + _expanded(extra, project)
    seen, missing = _closure(reqs)
    direct = {_name(r) for r in reqs}
    if direct & missing:
        pytest.skip(f"not installed here: {sorted(direct & missing)}")
    assert direct <= seen
    assert not seen & forbidden, f"mpfunc[{extra}] pulls in {sorted(seen & forbidden)}"


def _this_checkouts_metadata():
    for dist in metadata.distributions(name="mpfunc"):
        url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        if url.rstrip("/") == ROOT.as_uri() or Path(str(dist.locate_file(""))) == ROOT:
            yield dist


def test_installed_metadata_matches_pyproject():
    # In CI the .venv is an editable install of this checkout; its metadata must say what
    # pyproject.toml says (a stale .venv would test the wrong extras).
    dists = list(_this_checkouts_metadata())
    if not dists:
        pytest.skip("mpfunc is not installed from this checkout")
    project = _pyproject()
    declared = {r.split(";")[0].replace(" ", "") for r in project["dependencies"]}
    for reqs in project["optional-dependencies"].values():  # (environment markers aside)
        declared |= {r.split(";")[0].replace(" ", "") for r in reqs}
    for dist in dists:
        assert sorted(dist.metadata.get_all("Provides-Extra")) == sorted(
            project["optional-dependencies"])
        requires = {r.split(";")[0].replace(" ", "") for r in dist.requires or []}
        assert requires == declared, dist


def test_license_and_project_metadata():
    project = _pyproject()
    text = (ROOT / "LICENSE").read_text()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000
    assert project["authors"] and project["urls"]["Source"].startswith("https://")


def test_ci_runs_every_step_in_a_clone_named_mpfunc(tmp_path):
    # .ci/run from a checkout with another folder name runs its make targets in a clone
    # named `mpfunc` (a user's layout, .venv inside), then removes that clone. `make` and
    # `chromium` are stand-ins here: they say where they ran.
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    checkout, bin_dir, tmp = tmp_path / "checkout", tmp_path / "bin", tmp_path / "tmp"
    bin_dir.mkdir(), tmp.mkdir()
    log = tmp_path / "make.log"
    (bin_dir / "make").write_text(f'#!/bin/sh\necho "$PWD $*" >> {log}\n')
    (bin_dir / "chromium").write_text("#!/bin/sh\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.com"]
    subprocess.run([*git, "clone", "--quiet", str(ROOT), str(checkout)], check=True)
    # This checkout's .ci/run as it is now, committed in the copy (the clone takes HEAD).
    (checkout / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    subprocess.run([*git, "-C", str(checkout), "commit", "--quiet", "--allow-empty", "-am",
                    "ci"], check=True)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(tmp))
    out = subprocess.run(["bash", str(checkout / ".ci" / "run")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    runs = [line.split(" ", 1) for line in log.read_text().splitlines()]
    assert [target for _, target in runs] == ["venv", "test", "test-slow", "lint", "docs",
                                              "test-latest", "test-oldest", "test-wheel"]
    assert {Path(where).name for where, _ in runs} == {"mpfunc"}
    # Each stage's wall time, then all of them and the total.
    summary = out.stdout.split("ci: stage times\n")[1].splitlines()
    assert [line.split()[1] for line in summary] == [
        "chromium", "node", "install", "test", "test-slow", "lint", "docs", "latest", "oldest",
        "wheel", "total"]
    assert all(re.fullmatch(r"ci:   \S+ +\d+:\d\d", line) for line in summary), summary
    assert {Path(where).parent.parent for where, _ in runs} == {tmp}
    assert list(tmp.iterdir()) == []  # the clone is gone


@pytest.mark.slow  # a second pytest collecting the whole suite, about 23 s
def test_pytest_collects_without_triton_and_skips_its_module_saying_why():
    # The doctest collector imports every module; fp8/triton_kernels.py imports Triton, which
    # only the `triton` extra (or a CUDA torch) brings. Without it the run goes on.
    out = run_without("triton", """
        import pytest
        rc = pytest.main(["-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-rs",
                          "mpfunc_torch/_src/fp8/triton_kernels.py", "mpfunc_torch/_src/loss_scale.py"])
        raise SystemExit(int(rc))
    """)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("SKIPPED [1] conftest.py:25: mpfunc_torch/_src/fp8/triton_kernels.py: No module named "
            "'triton' (the `triton` extra)") in out.stdout
    assert " passed" in out.stdout  # the other module's doctests still ran


def test_one_version_read_by_both_packages_the_metadata_and_the_docs():
    import tomllib

    from _mpfunc_common.version import __version__

    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["dynamic"] == ["version"] and "version" not in pyproject["project"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "_mpfunc_common.version.__version__"}
    out = run_without("", """
        import mpfunc, mpfunc_torch, runpy
        conf = runpy.run_path("docs/conf.py")
        print(mpfunc.__version__, mpfunc_torch.__version__, conf["release"])
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [__version__] * 3
    # Nowhere else: a second copy would drift.
    copies = [p for p in ROOT.glob("*/*.py") if re.search(
        r"^(__version__|release|version)\s*=\s*[\"']\d", p.read_text(), re.M)]
    assert [p.relative_to(ROOT).as_posix() for p in copies] == ["_mpfunc_common/version.py"]


def test_the_changelog_has_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    from _mpfunc_common.version import __version__

    assert "## [Unreleased]" in text and "Semantic Versioning" in text
    # Not yet published: the version the packages report is named as the first release.
    assert f"The first release will be {__version__}" in " ".join(text.split())


def test_typed_packages_and_python_classifiers():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project, tool = pyproject["project"], pyproject["tool"]
    for package in ("mpfunc", "mpfunc_torch", "_mpfunc_common"):
        assert (ROOT / package / "py.typed").exists()
        assert tool["setuptools"]["package-data"][package] == ["py.typed"]
    assert "Typing :: Typed" in project["classifiers"]
    low = re.fullmatch(r">=3\.(\d+)", project["requires-python"]).group(1)
    versions = sorted(int(c.rsplit(".", 1)[1]) for c in project["classifiers"]
                      if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert versions[0] == int(low), (low, versions)
    assert "/tree/" not in project["urls"]["Documentation"]  # the site, not a source folder


def test_every_lower_bound_is_pinned_in_the_oldest_constraints():
    # make test-oldest installs constraints-oldest.txt: what pyproject's `>=` bounds of
    # the runtime extras claim must be what that environment runs.
    project = _pyproject()
    pins = dict(line.split("==") for line in
                (ROOT / "constraints-oldest.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    runtime = ["jax", "flax", "torch", "triton", "lightning", "hf"]
    bounds = {}
    for req in [*project["dependencies"], *(r for e in runtime for r in _expanded(e, project))]:
        m = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+?)(?:\[.*\])?>=([\d.]+)(;.*)?", req.replace(" ", ""))
        if m:
            bounds[_name(m.group(1))] = m.group(2)
    assert {"numpy", "jax", "optax", "flax", "torch", "transformers"} <= set(bounds)
    for name, low in bounds.items():
        pinned = pins.get(name)
        assert pinned is not None, f"{name}>={low} has no pin in constraints-oldest.txt"
        assert pinned.split(".")[:len(low.split("."))] == low.split(".") or \
            pinned == low + ".0" * (3 - len(low.split("."))), (name, low, pinned)
