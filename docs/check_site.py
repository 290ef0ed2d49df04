"""Checks a built documentation site (``make docs`` runs it after Sphinx).

* every name in ``mpfunc.__all__`` and ``mpfunc_torch.__all__`` has an API entry under
  its own package's name (in the site's ``objects.inv``, so ``{py:class}`` links to it
  resolve) and an anchor of that name on the package's page (a torch name that is the
  very object of the JAX one, such as a shared config class, too: its docstring is
  indexed once, under ``mpfunc``);
* every link from a guide page into the API reference (a ``{py:func}`` / ``{py:class}``
  role) resolves: an unresolved one renders as plain code, with no warning;
* every image a page shows exists in the site;
* the search index holds ``dynamic_scale`` (the search box finds it).

    python docs/check_site.py docs/_build/html
"""

from __future__ import annotations

import importlib
import re
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def inventory(site: Path) -> set[str]:
    """The object names in the site's objects.inv (Sphinx's inventory format 2)."""
    data = (site / "objects.inv").read_bytes()
    body = zlib.decompress(data.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def missing_api_entries(site: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    import mpfunc
    import mpfunc_torch

    names = inventory(site)
    missing = []
    for module in (mpfunc, mpfunc_torch):
        page = (site / "api" / f"{module.__name__}.html").read_text()
        for n in module.__all__:
            full = f"{module.__name__}.{n}"
            if full not in names or f'id="{full}"' not in page:
                missing.append(full)
    for sub in ("lightning", "transformers"):  # the trainer modules (their own pages)
        module = importlib.import_module(f"mpfunc_torch.{sub}")
        missing += [f"mpfunc_torch.{sub}.{n}" for n in module.__all__
                    if f"mpfunc_torch.{sub}.{n}" not in names]
    return missing


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs += [v for k, v in attrs if k == "src" and v]


def missing_images(site: Path) -> list[str]:
    out = []
    for page in site.rglob("*.html"):
        parser = _Images()
        parser.feed(page.read_text())
        for src in parser.srcs:
            if re.match(r"^(https?:|data:)", src):
                continue
            if not (page.parent / src.split("#")[0]).resolve().exists():
                out.append(f"{page.relative_to(site)}: {src}")
    return out


class _ApiLinks(HTMLParser):
    """The text of every ``xref py`` code element, and whether a link encloses it."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, bool]] = []
        self._open: list[str] = []  # tags
        self._text: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "code" and "xref" in classes and "py" in classes:
            self._text, self._linked = [], "a" in self._open
        self._open.append(tag)

    def handle_endtag(self, tag):
        if tag in self._open:
            while self._open.pop() != tag:
                pass
        if tag == "code" and self._text is not None:
            self.links.append(("".join(self._text), self._linked))
            self._text = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


def unresolved_api_links(site: Path) -> list[str]:
    """Guide-page roles into the API reference that found no entry."""
    out = []
    for page in sorted(site.glob("*.html")):
        parser = _ApiLinks()
        parser.feed(page.read_text())
        out += [f"{page.name}: {text}" for text, linked in parser.links if not linked]
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    site = Path(args[0] if args else ROOT / "docs" / "_build" / "html")
    problems = [f"no API entry: {n}" for n in missing_api_entries(site)]
    problems += [f"unresolved API link: {x}" for x in unresolved_api_links(site)]
    problems += [f"missing image: {i}" for i in missing_images(site)]
    if "dynamic_scale" not in (site / "searchindex.js").read_text():
        problems.append("the search index does not hold dynamic_scale")
    for p in problems:
        print(f"check_site: {p}", file=sys.stderr)
    print(f"check_site: {site}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
