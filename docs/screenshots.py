"""Looks at the built site as a reader would, in headless Chromium.

Serves ``docs/_build/html`` on localhost, takes screenshots of the landing page, an API
page and the benchmarks page, and runs the search box's query for ``dynamic_scale``
(Sphinx's search runs in the page's JavaScript, so the query goes through Chromium).

    python docs/screenshots.py [SITE] [--out DIR]

Prints one line per check and exits 1 if one fails. Needs Debian's ``chromium``.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"landing": "index.html", "api": "api/mpfunc.html", "benchmarks": "benchmarks.html"}
# The flags a sandboxed root Chromium needs on a machine with a closed network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@functools.cache
def _profile() -> str:
    return tempfile.mkdtemp(prefix="mpfunc-docs-chromium-")


def run_chromium(*args: str, timeout: float = 60) -> str:
    cmd = [chromium(), *FLAGS, f"--user-data-dir={_profile()}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    return out.stdout


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def screenshot(url: str, path: Path) -> None:
    run_chromium("--window-size=1280,900", "--hide-scrollbars", f"--screenshot={path}", url)


def search(url: str, query: str) -> list[str]:
    """The result links the site's search page lists for ``query``."""
    dom = run_chromium("--virtual-time-budget=10000", "--dump-dom",
                       f"{url}/search.html?q={query}")
    return re.findall(r'<a href="([^"]+)"[^>]*data-score', dom)


def is_blank(path: Path) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    return float(pixels.std()) < 0.02


def check(site: Path, out: Path) -> list[str]:
    """Runs every check; returns the problems (empty when all passed)."""
    out.mkdir(parents=True, exist_ok=True)
    server, url = serve(site)
    problems = []
    try:
        for name, page in PAGES.items():
            png = out / f"docs-{name}.png"
            png.unlink(missing_ok=True)
            screenshot(f"{url}/{page}", png)
            ok = png.exists() and png.stat().st_size > 10_000 and not is_blank(png)
            print(f"screenshot {name} ({page}): {png if ok else 'FAILED'}")
            if not ok:
                problems.append(f"no screenshot of {page}")
        hits = search(url, "dynamic_scale")
        print(f"search 'dynamic_scale': {len(hits)} results, first {hits[:1]}")
        if not any("mpfunc.dynamic_scale" in h for h in hits):
            problems.append("the search box does not find mpfunc.dynamic_scale")
    finally:
        server.shutdown()
        server.server_close()
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site", nargs="?", default=str(ROOT / "docs" / "_build" / "html"))
    ap.add_argument("--out", default=str(ROOT / "out"), help="folder for the PNGs")
    args = ap.parse_args(argv)
    if chromium() is None:
        print("docs/screenshots.py: needs chromium (apt-get install chromium)",
              file=sys.stderr)
        return 2
    problems = check(Path(args.site), Path(args.out))
    for p in problems:
        print(f"screenshots: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
