"""Checks a built documentation site (``make docs`` runs it after Sphinx).

* every name in ``mpfunc.__all__`` and ``mpfunc_torch.__all__`` has an API entry (in
  the site's ``objects.inv``; a torch name that is the very object of the JAX one, such
  as a shared config class, is documented once, under ``mpfunc``, and linked);
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
    missing = [f"mpfunc.{n}" for n in mpfunc.__all__ if f"mpfunc.{n}" not in names]
    page = (site / "api" / "mpfunc_torch.html").read_text()
    for n in mpfunc_torch.__all__:
        shared = getattr(mpfunc, n, None) is getattr(mpfunc_torch, n)
        if shared:  # documented under mpfunc; the torch page names it and links there
            if f"mpfunc.{n}" not in names or f'id="{n.lower()}"' not in page:
                missing.append(f"mpfunc_torch.{n} (shared with mpfunc)")
        elif f"mpfunc_torch.{n}" not in names:
            missing.append(f"mpfunc_torch.{n}")
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


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    site = Path(args[0] if args else ROOT / "docs" / "_build" / "html")
    problems = [f"no API entry: {n}" for n in missing_api_entries(site)]
    problems += [f"missing image: {i}" for i in missing_images(site)]
    if "dynamic_scale" not in (site / "searchindex.js").read_text():
        problems.append("the search index does not hold dynamic_scale")
    for p in problems:
        print(f"check_site: {p}", file=sys.stderr)
    print(f"check_site: {site}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
