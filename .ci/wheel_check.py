"""What `make test-wheel` checks of the built distributions (run by the Makefile).

    python .ci/wheel_check.py sdist DIST_DIR
        the sdist carries every tracked file its tests read (the whole tree but .ci/ and
        the git files), so `pytest` runs from an unpacked sdist;
    python .ci/wheel_check.py quickstart {jax,torch} PYTHON
        runs the README's quick start for that framework with PYTHON (a fresh venv with
        the wheel and one extra), from an empty folder, so `mpfunc` comes from the
        installed wheel and not from this checkout; its output must be the line the
        README shows under the block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADINGS = {"jax": "## JAX quick start", "torch": "## PyTorch quick start"}


def readme_block(framework: str) -> tuple[str, str]:
    """The first python block under the framework's quick-start heading, and the output
    it shows (its last line, a comment)."""
    text = (ROOT / "README.md").read_text()
    section = text.split(HEADINGS[framework], 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = code.rstrip().splitlines()[-1]
    assert expected.startswith("# "), expected
    return code, expected[2:]


def quickstart(framework: str, python: str) -> None:
    code, expected = readme_block(framework)
    python = os.path.abspath(python)  # not resolve(): the venv's python is a symlink
    package = "mpfunc" if framework == "jax" else "mpfunc_torch"
    where = f"import {package}, sys; print({package}.__file__, file=sys.stderr)\n"
    with tempfile.TemporaryDirectory() as empty:
        out = subprocess.run([python, "-c", where + code], capture_output=True, text=True,
                             cwd=empty, timeout=600, env={"PATH": "/usr/bin:/bin",
                                                          "JAX_PLATFORMS": "cpu"})
    if out.returncode != 0:
        sys.exit(f"the {framework} quick start failed:\n{out.stderr[-4000:]}")
    origin = out.stderr.splitlines()[0]
    if "site-packages" not in origin or Path(origin).is_relative_to(ROOT / package):
        sys.exit(f"{package} was imported from {origin}, not from the installed wheel")
    got = out.stdout.strip().splitlines()[-1]
    if got != expected:
        sys.exit(f"the {framework} quick start printed {got!r}; the README shows {expected!r}")
    print(f"{framework} quick start from the wheel ({origin}): {got}")


def sdist(dist: str) -> None:
    (path,) = Path(dist).glob("*.tar.gz")
    with tarfile.open(path) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT,
                             check=True).stdout.split()
    wanted = {f for f in tracked if not f.startswith((".ci/", ".git"))}
    missing = sorted(wanted - names)
    if missing:
        sys.exit(f"{path.name} lacks {len(missing)} tracked files: {missing[:10]}")
    print(f"{path.name}: all {len(wanted)} tracked files (but .ci/ and .git*) are in it")


if __name__ == "__main__":
    if sys.argv[1] == "sdist":
        sdist(sys.argv[2])
    else:
        quickstart(sys.argv[2], sys.argv[3])
