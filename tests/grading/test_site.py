"""``python -m labkit site``: the executed copies and the cheat sheet as a static site whose
every page exists, every relative link resolves (anchors included) and every image is embedded.
Small fixture notebooks, written here: the lesson notebooks' copies exist only after a full run
(tests/grading/test_pytest_plugin.py tests that the plugin writes them)."""
from __future__ import annotations

import base64
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

from labkit.grading import site

ROOT = Path(__file__).resolve().parents[2]
# a 1×1 PNG
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9Q"
                       "DwADhgGAWjR9awAAAABJRU5ErkJggg==")
RUN = {"notebook": "solutions/01_first.ipynb", "start": "2026-01-02T03:04:05+00:00",
       "end": "2026-01-02T03:05:05+00:00", "torch": "2.13.0", "failed": ["In [2]"]}


def _executed(folder: Path) -> None:
    """Two executed copies, as the plugin writes them: a header cell, headings, links between
    the notebooks and to the cheat sheet, a PNG output and a markdown image."""
    folder.mkdir()
    (folder / "figure.png").write_bytes(PNG)
    header = nbformat.v4.new_markdown_cell("> **Executed copy** of a run")
    header.metadata["labkit"] = {"executed": RUN}
    plot = nbformat.v4.new_code_cell("plot()", execution_count=1)
    plot.outputs = [nbformat.v4.new_output("display_data", data={
        "image/png": base64.b64encode(PNG).decode(), "text/plain": "<Figure>"})]
    first = nbformat.v4.new_notebook(cells=[
        header,
        nbformat.v4.new_markdown_cell("# 01 · The first lesson\n\nNext: [02](02_second.ipynb), "
                                      "its [second section](02_second.ipynb#Section-two); the "
                                      "[cheat sheet](cheatsheet.md); [below](#Plots)."),
        nbformat.v4.new_markdown_cell("## Plots\n\n![a figure](figure.png)"),
        plot])
    second = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 02 · The second lesson"),
        nbformat.v4.new_markdown_cell("## Section two\n\nBack to [01](01_first.ipynb)."),
        nbformat.v4.new_code_cell("print(1)", execution_count=1, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="1\n")])])
    nbformat.write(first, folder / "01_first.ipynb")
    nbformat.write(second, folder / "02_second.ipynb")


def _cheatsheet(path: Path) -> Path:
    path.write_text("# Cheat sheet\n\n| term | where |\n|---|---|\n"
                    "| ring | [01](01_first.ipynb), [02 §2](02_second.ipynb#Section-two) |\n")
    return path


class _Page(HTMLParser):
    """The ids, the links (href, src) and the external scripts of one page."""

    def __init__(self, text: str):
        super().__init__()
        self.ids, self.links = set(), []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name) is not None:
                self.links.append((tag, attrs[name]))


def _problems(out: Path) -> list[str]:
    """Every relative link of every page that does not resolve, every image not embedded."""
    pages = {p.name: _Page(p.read_text()) for p in out.glob("*.html")}
    bad = []
    for name, page in pages.items():
        for tag, link in page.links:
            url = urlsplit(link)
            if tag == "img" and url.scheme != "data":
                bad.append(f"{name}: an image not embedded: {link[:80]}")
            if url.scheme or url.netloc:
                continue                                   # data: images, MathJax's CDN
            target = unquote(url.path) or name
            if target not in pages:
                bad.append(f"{name}: {link} (no page {target})")
            elif url.fragment and not {url.fragment, unquote(url.fragment)} & pages[target].ids:
                bad.append(f"{name}: {link} (no id {url.fragment!r} in {target})")
    return bad


def test_the_site_builds_and_every_link_resolves_and_every_image_is_embedded(tmp_path):
    _executed(tmp_path / "executed")
    out = tmp_path / "site"
    written = site.build(tmp_path / "executed", out, _cheatsheet(tmp_path / "cheatsheet.md"),
                         images=tmp_path / "executed")
    names = ["index.html", "01_first.html", "02_second.html", "cheatsheet.html"]
    assert [p.name for p in written] == names
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    assert _problems(out) == []

    pages = {n: (out / n).read_text() for n in names}
    links = {n: {link for _, link in _Page(t).links} for n, t in pages.items()}
    assert {"01_first.html", "02_second.html", "cheatsheet.html"} <= links["index.html"]
    assert "01 · The first lesson" in pages["index.html"] and "In [2]" in pages["index.html"]
    assert {"02_second.html", "02_second.html#Section-two", "cheatsheet.html", "#Plots",
            "index.html"} <= links["01_first.html"]
    assert {"index.html", "01_first.html", "02_second.html#Section-two"} <= links["cheatsheet.html"]
    assert "<table>" in pages["cheatsheet.html"]
    assert "Executed copy" in pages["01_first.html"]
    images = [link for _, link in _Page(pages["01_first.html"]).links
              if link.startswith("data:image/png;base64,")]
    assert len(images) == 2, images                     # the output and the markdown image
    for name, text in pages.items():
        assert not [link for _, link in _Page(text).links
                    if ".ipynb" in link or "cheatsheet.md" in link], name
        scripts = [link for tag, link in _Page(text).links if tag == "script"]
        assert all(s.startswith("https://cdnjs.cloudflare.com/ajax/libs/mathjax/")
                   for s in scripts), scripts         # only MathJax comes from the network


def test_the_link_check_catches_a_dangling_link_an_unknown_anchor_and_an_image_file(tmp_path):
    """The check above can fail."""
    (tmp_path / "a.html").write_text('<a href="b.html">b</a> <a href="#nowhere">x</a> '
                                     '<a href="#here">y</a> <img src="a.html"> <p id="here"></p>')
    assert _problems(tmp_path) == ["a.html: b.html (no page b.html)",
                                   "a.html: #nowhere (no id 'nowhere' in a.html)",
                                   "a.html: an image not embedded: a.html"]


def test_without_executed_copies_the_command_says_how_to_make_them(tmp_path):
    (tmp_path / "executed").mkdir()
    out = subprocess.run([sys.executable, "-m", "labkit", "site", "--executed",
                          str(tmp_path / "executed"), "--out", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "no executed notebooks in" in out.stderr and ".venv/bin/python -m pytest" in out.stderr
    assert not (tmp_path / "site").exists()
    with pytest.raises(site.SiteError, match="python -m pytest"):
        site.build(tmp_path / "nowhere", tmp_path / "site", _cheatsheet(tmp_path / "c.md"))
