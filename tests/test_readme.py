"""Every ```python block of README.md and of the documentation pages (docs/*.md) runs,
as shown, as a test.

The convention (for everyone who edits the README):

* Every fenced block opened with ```python (or ```py) is a test, in README order; blocks
  in other languages (```bash, ```text, a bare ```) are not run. New blocks are picked up
  automatically.
* Each file is read on its own. Its blocks share one namespace, top to bottom, so a
  block may continue the previous one
  (use a name defined above it). Write each block as a complete program or as a clear
  continuation of the block before it: what the README shows must work as shown.
* An HTML comment right before a block (blank lines allowed in between) changes how that
  block runs. It does not render on GitHub, so use it sparingly:

      <!-- readme-test: fresh -->       start this block in an empty namespace
      <!-- readme-test: skip REASON --> do not run it (say why, e.g. "needs a CUDA GPU")
      <!-- readme-test: setup
      code that runs, hidden, before the block (e.g. a stand-in for the user's data)
      -->

  Several directives may precede one block. An unknown directive, a skip without a
  reason or a directive followed by no python block fails the test, so a typo cannot
  hide a block.
* Blocks run in the test process (8 forced CPU devices, warnings are errors) but under
  JAX's *standard* dtype promotion, the default a reader has, not the suite's strict one.
* Each block is its own test, named after its file and heading. A test re-runs the
  blocks above it when the worker running it has not (pytest-xdist may split them).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import textwrap
import types
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose blocks run: the README and every hand-written docs page (the API
# reference pages are generated from the docstrings, whose examples run as doctests).
PAGES = [README] + sorted(p for p in (ROOT / "docs").glob("*.md"))

_DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(.*?)-->", re.S)
# A fence: ``` then an optional language and, for MyST directives, arguments
# (```{include} ../BENCHMARKS.md).
_FENCE = re.compile(r"^(\s*)```(\S*)(?:\s.*)?$")


@dataclasses.dataclass
class Block:
    index: int          # 0-based among the python blocks of its page
    line: int           # 1-based line of the opening fence
    heading: str        # the nearest heading above it
    code: str
    setup: str = ""
    fresh: bool = False
    skip: str | None = None
    page: str = "README.md"  # relative to the repository root

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-") or "top"
        return f"{Path(self.page).stem}-{self.index:02d}-{slug}-line{self.line}"


def _apply(directive: str, block: Block) -> None:
    text = directive.strip()
    word = text.split(None, 1)[0] if text else ""
    rest = text[len(word):]
    if word == "fresh" and not rest.strip():
        block.fresh = True
    elif word == "skip":
        if not rest.strip():
            raise ValueError(f"{block.page} line {block.line}: `readme-test: skip` needs a reason")
        block.skip = rest.strip()
    elif word == "setup":
        block.setup += textwrap.dedent(rest.lstrip("\n")) + "\n"
    else:
        raise ValueError(f"{block.page} line {block.line}: unknown readme-test directive "
                         f"{text[:40]!r}; use fresh, skip REASON or setup")


def parse(text: str, page: str = "README.md") -> list[Block]:
    """The python blocks of a markdown text, with their directives applied."""
    lines = text.splitlines()
    blocks: list[Block] = []
    heading, pending, i = "", [], 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            indent, lang = fence.groups()
            start, body = i, []
            i += 1
            while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{page} line {start + 1}: unclosed ``` fence")
            if lang.lower() in ("python", "py"):
                block = Block(len(blocks), start + 1, heading, "\n".join(body) + "\n",
                              page=page)
                for directive, _ in pending:
                    _apply(directive, block)
                blocks.append(block)
            elif pending:
                raise ValueError(f"{page} line {pending[0][1]}: a readme-test directive "
                                 f"precedes a ```{lang or ' (bare)'} block, not a python one")
            pending = []
        elif line.lstrip().startswith("<!--") and "readme-test:" in line:
            start, chunk = i, [line]
            while "-->" not in lines[i]:
                i += 1
                if i == len(lines):
                    raise ValueError(f"{page} line {start + 1}: unclosed readme-test comment")
                chunk.append(lines[i])
            match = _DIRECTIVE.search("\n".join(chunk))
            pending.append((match.group(1), start + 1))
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
            if pending:
                raise ValueError(f"{page} line {pending[0][1]}: a readme-test directive "
                                 "with no python block after it")
        elif line.strip() and pending:
            raise ValueError(f"{page} line {pending[0][1]}: a readme-test directive must "
                             "come right before its python block")
        i += 1
    if pending:
        raise ValueError(f"{page} line {pending[0][1]}: a readme-test directive with no "
                         "python block after it")
    return blocks


BY_PAGE = {str(p.relative_to(ROOT)): parse(p.read_text(), str(p.relative_to(ROOT)))
           for p in PAGES}
BLOCKS = [b for blocks in BY_PAGE.values() for b in blocks]

# Per worker: the namespace after the last block run, and that block (page, index).
_state: dict = {"namespace": None, "last": None}


def _new_namespace() -> dict:
    # A real module, so code that looks its module up (pickle, dataclasses with string
    # annotations) finds the README's namespace.
    module = types.ModuleType("__readme__")
    sys.modules["__readme__"] = module
    return module.__dict__


def _run(block: Block, namespace: dict) -> None:
    filename = f"{block.page}:{block.line}"
    # Fences start at line block.line, so line N of the code is README line block.line + N.
    code = "\n" * block.line + block.code
    cwd = os.getcwd()
    os.chdir(ROOT)  # where a reader of the README runs it
    try:
        with jax.numpy_dtype_promotion("standard"):
            if block.setup:
                exec(compile(block.setup, f"{filename} (readme-test setup)", "exec"), namespace)
            exec(compile(code, filename, "exec"), namespace)
    finally:
        os.chdir(cwd)


def _namespace_before(block: Block) -> tuple[dict, list[str]]:
    """The namespace ``block`` starts from, running the blocks above it on its page if
    needed.

    A block above that fails here is reported by its own test; this one still runs (it
    may not need it), and its error names the failed blocks.
    """
    page, index = block.page, block.index
    if _state["namespace"] is not None and _state["last"] == (page, index - 1):
        return _state["namespace"], []
    blocks = BY_PAGE[page]
    start = index
    while start > 0 and not blocks[start].fresh:
        start -= 1
    namespace, failed = _new_namespace(), []
    for above in blocks[start:index]:
        if above.skip is None:
            try:
                _run(above, namespace)
            except Exception as e:
                failed.append(f"{page} line {above.line} ({type(e).__name__}: {e})")
    return namespace, failed


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block):
    if block.skip is not None:
        pytest.skip(block.skip)
    if block.fresh:
        namespace, failed = _new_namespace(), []
    else:
        namespace, failed = _namespace_before(block)
    _state["namespace"], _state["last"] = None, None
    try:
        _run(block, namespace)
    except Exception as e:
        if failed and hasattr(e, "add_note"):
            e.add_note("blocks above this one failed, so names they define may be missing: "
                       + "; ".join(failed))
        raise
    _state["namespace"], _state["last"] = namespace, (block.page, block.index)


def test_the_quick_starts_are_found():
    # Guards the parser: if it stopped finding blocks, every test above would vanish.
    headings = {b.heading for b in BY_PAGE["README.md"]}
    assert {"JAX quick start", "PyTorch quick start"} <= headings, headings
    assert all(b.code.strip() for b in BLOCKS)


def test_directives_are_parsed_and_checked():
    text = "\n".join([
        "# A", "<!-- readme-test: setup", "x = 1", "-->", "", "```python", "print(x)", "```",
        "<!-- readme-test: fresh -->", "```py", "y = 2", "```",
        "```bash", "echo not run", "```",
        "<!-- readme-test: skip needs a CUDA GPU -->", "```python", "import cupy", "```",
    ])
    a, b, c = parse(text)
    assert (a.setup, a.code, a.heading, a.line) == ("x = 1\n", "print(x)\n", "A", 6)
    assert b.fresh and not a.fresh and b.code == "y = 2\n"
    assert c.skip == "needs a CUDA GPU"
    for bad, message in [
        ("<!-- readme-test: skip -->\n```python\npass\n```", "needs a reason"),
        ("<!-- readme-test: setpu x=1 -->\n```python\npass\n```", "unknown readme-test"),
        ("<!-- readme-test: fresh -->\n```bash\nls\n```", "not a python one"),
        ("<!-- readme-test: fresh -->\ntext\n```python\npass\n```", "right before"),
        ("<!-- readme-test: fresh -->\n", "no python block"),
        ("```python\npass\n", "unclosed"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse(bad)


def test_a_failing_block_fails_with_its_readme_line():
    (block,) = parse("# T\n\n```python\nx = 1\nraise RuntimeError('boom')\n```\n")
    with pytest.raises(RuntimeError, match="boom") as info:
        _run(block, _new_namespace())
    frames = [f for f in info.traceback if str(f.path).startswith("README.md")]
    assert frames and frames[-1].lineno + 1 == 5  # README line 5 (pytest's lineno is 0-based)


def test_blocks_run_as_a_module_a_reader_could_pickle_from():
    first, second = parse("\n".join([
        "```python", "from __future__ import annotations", "import dataclasses, pickle", "",
        "@dataclasses.dataclass", "class Point:", "    x: int", "```",
        "```python", "assert pickle.loads(pickle.dumps(Point(3))) == Point(3)", "```",
    ]))
    namespace = _new_namespace()
    _run(first, namespace)
    _run(second, namespace)  # the second block continues the first one's namespace
    assert namespace["Point"].__module__ == "__readme__"
