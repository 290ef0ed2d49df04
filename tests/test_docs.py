"""The documentation site: it builds with warnings as errors, every public name has an
API entry, and a reader in a browser sees pages, images and a working search box.

Building takes a minute on 2 cores, so these are slow tests (CI runs them, and
``make docs`` runs the same build and checks). The code blocks of the pages run as tests
in test_readme.py.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import check_site  # noqa: E402
import plots  # noqa: E402, F401 - used in a test
import screenshots  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.slow
def test_the_site_builds_clean_with_every_api_entry(site):
    assert check_site.missing_api_entries(site) == []
    assert check_site.missing_images(site) == []
    assert "dynamic_scale" in (site / "searchindex.js").read_text()


@pytest.mark.slow
def test_a_missing_api_entry_is_caught(site, tmp_path):
    # The check reads the inventory: drop one name from it and the check names it.
    import shutil
    import zlib

    broken = tmp_path / "html"
    shutil.copytree(site, broken)
    data = (broken / "objects.inv").read_bytes()
    head, body = data.split(b"\n", 4)[:4], zlib.decompress(data.split(b"\n", 4)[4])
    body = b"\n".join(line for line in body.split(b"\n")
                      if not line.startswith(b"mpfunc.dynamic_scale "))
    (broken / "objects.inv").write_bytes(b"\n".join(head) + b"\n" + zlib.compress(body))
    assert check_site.missing_api_entries(broken) == ["mpfunc.dynamic_scale"]
    # A class mpfunc_torch shares with mpfunc needs its own anchor on the torch page.
    page = broken / "api" / "mpfunc_torch.html"
    page.write_text(page.read_text().replace('id="mpfunc_torch.FP16NaiveMixedPrecision"', ""))
    assert check_site.missing_api_entries(broken) == ["mpfunc.dynamic_scale",
                                                      "mpfunc_torch.FP16NaiveMixedPrecision"]


@pytest.mark.slow
def test_a_reader_sees_the_pages_and_the_search_box_works(site, tmp_path):
    if screenshots.chromium() is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    assert screenshots.check(site, tmp_path) == []
    for name in screenshots.PAGES:
        assert (tmp_path / f"docs-{name}.png").stat().st_size > 10_000


def test_the_readme_is_a_front_door():
    # At most 250 lines, and every page it links to exists (the rest lives in docs/).
    # The README is also the package index's page, where a relative link leads nowhere:
    # every link is absolute, and those into this repository name a file it has.
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)]+)\)", text)
    assert targets and all(t.startswith("https://") for t in targets), \
        [t for t in targets if not t.startswith("https://")]
    repo = "https://github.com/mpfunc/mpfunc/blob/main/"
    links = [t[len(repo):].split("#")[0] for t in targets if t.startswith(repo)]
    assert links and all((ROOT / link).exists() for link in links), links
    for page in ("getting-started", "modes", "loss-scaling", "precision-report",
                 "autocast-policies", "flax", "fp8", "pytorch", "trainers", "scaling-out",
                 "checkpoints", "migration", "known-limits"):
        assert f"docs/{page}.md" in links, page


def test_every_page_is_in_the_site_navigation():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.stem != "index":
            assert f"\n{page.stem}\n" in index, page.name


def test_the_benchmark_plot_is_drawn_from_the_recorded_table(tmp_path):
    text = (ROOT / "BENCHMARKS.md").read_text()
    rows = plots.step_peak_rows(text)
    names = [n for n, _ in rows]
    assert names[:2] == ["fp32", "hand-written fp16 + fp32 masters"]
    assert "mpfunc naive, step_chunks=4" in names and all(10 < v < 25 for _, v in rows)
    # The bars are the table's numbers: changing one in the text changes the row.
    changed = text.replace("| mpfunc naive | 18.216 |", "| mpfunc naive | 19.5 |")
    assert dict(plots.step_peak_rows(changed))["mpfunc naive"] == 19.5
    drawn = plots.plot_step_peak(text, tmp_path / "p.png")
    assert drawn == rows and (tmp_path / "p.png").stat().st_size > 10_000
    # The docs show the committed figures.
    for png in ("bench-step-peak.png", "compare_modes.png"):
        assert (ROOT / "docs" / png).stat().st_size > 10_000, png


def first_unlinked_mentions(text: str, public: set[str]) -> list[str]:
    """Public names a page writes as `mpfunc.X` / `mpfunc_torch.X` (inline code, outside
    code blocks, headings and link texts) before any ``{py:...}`` role links them."""
    linked, out = set(), []
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence or line.startswith("#"):
            continue
        for m in re.finditer(r"(\{py:\w+\})?(?<!`)`([^`]+)`(?!`)", line):
            role, code = m.groups()
            if role:
                target = re.search(r"<([\w.]+)>$", code)
                linked.add(target.group(1) if target else code.split("(")[0])
                continue
            name = re.match(r"(mpfunc_torch|mpfunc)\.\w+", code)
            if (name and name.group(0) in public and name.group(0) not in linked
                    and not line[:m.start()].endswith("[")):
                out.append(f"`{code}`")
                linked.add(name.group(0))  # one report per name
    return out


def test_each_guide_page_links_a_public_name_where_it_first_writes_it():
    # A reader can follow a page's first `mpfunc.dynamic_scale` to its API entry: write
    # {py:func}`mpfunc.dynamic_scale(...) <mpfunc.dynamic_scale>` there (or link an
    # earlier bare mention); `make docs` checks that each such link resolves.
    import mpfunc
    import mpfunc_torch

    public = {f"{m.__name__}.{n}" for m in (mpfunc, mpfunc_torch) for n in m.__all__}
    unlinked = {page.name: found for page in sorted((ROOT / "docs").glob("*.md"))
                if (found := first_unlinked_mentions(page.read_text(), public))}
    assert unlinked == {}
    # The check finds what it is meant to.
    assert first_unlinked_mentions("See `mpfunc.dynamic_scale(adam)`, then "
                                   "{py:func}`mpfunc.no_scale`, `mpfunc.no_scale`.\n",
                                   public) == ["`mpfunc.dynamic_scale(adam)`"]


def test_an_unresolved_api_link_is_caught(tmp_path):
    # Sphinx renders a role whose target does not exist as plain code, without a warning.
    (tmp_path / "page.html").write_text(
        '<p><a class="reference internal" href="api/mpfunc.html#mpfunc.no_scale"><code '
        'class="xref py py-func docutils literal"><span class="pre">no_scale</span></code></a>'
        ' and <code class="xref py py-func docutils literal"><span class="pre">mpfunc.nope'
        '</span></code></p>')
    assert check_site.unresolved_api_links(tmp_path) == ["page.html: mpfunc.nope"]
