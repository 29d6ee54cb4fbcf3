"""The reference run as a small static site: ``python -m labkit site [--executed DIR] [--out DIR]``.

The lab's test command (``.venv/bin/python -m pytest``) leaves an executed copy of every solved
notebook in ``build/executed/`` (:mod:`labkit.grading.pytest_plugin`: the outputs and figures
of that run, headed by when, where and with which torch it ran). This command renders them,
with the cheat sheet (``notebooks/cheatsheet.md``), into ``build/site/``:

* ``index.html``: the lessons, each with the first heading of its notebook and when it ran;
* ``NN_name.html``: one page per executed notebook (nbconvert's ``lab`` template, images
  embedded as ``data:`` URIs), with links to the index, the cheat sheet and its neighbours;
* ``cheatsheet.html``: the cheat sheet (mistune).

A link to a notebook (``03_ring_allreduce.ipynb#anchor``) or to ``cheatsheet.md`` becomes a link
to its page. Everything but math works offline: formulas are typeset by MathJax, which the page
loads from a CDN (each page's footer says so); offline they show as TeX. Nothing is executed.
"""
from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

from .. import syllabus
from ..runtime.errors import LabkitError

__all__ = ["SiteError", "build", "main"]

_ROOT = Path(__file__).resolve().parents[2]   # the repository: labkit/grading/ is two below
EXECUTED = _ROOT / "build" / "executed"
OUT = _ROOT / "build" / "site"
CHEATSHEET = _ROOT / "notebooks" / "cheatsheet.md"
SOLUTIONS = _ROOT / "solutions"               # a markdown image's path is relative to its notebook
TEST_COMMAND = ".venv/bin/python -m pytest"   # the README's; it writes build/executed/

_NOTEBOOK_LINK = re.compile(r'href="(\d\d_\w+)\.ipynb(#[^"]*)?"')
_CHEATSHEET_LINK = re.compile(r'href="cheatsheet\.md(#[^"]*)?"')
_FOOTER = ("Rendered by <code>python -m labkit site</code> from an executed copy: nothing runs "
           "here. Math is typeset by MathJax, loaded from cdnjs.cloudflare.com: offline, "
           "formulas show as TeX source; everything else works offline.")
_PAGE_FOOTER = "Rendered by <code>python -m labkit site</code>; this page works offline."
_CSS = """
nav.labkit, footer.labkit { font-family: sans-serif; font-size: 14px; padding: 8px 16px;
  background: #f4f4f4; border-bottom: 1px solid #ddd; }
footer.labkit { border-top: 1px solid #ddd; border-bottom: none; margin-top: 24px; color: #555; }
nav.labkit a { margin-right: 16px; }
"""
_PAGE_CSS = """
body { font-family: sans-serif; margin: 0; line-height: 1.5; }
main { max-width: 1100px; margin: 0 auto; padding: 0 16px; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 4px 8px; }
code { background: #f4f4f4; }
"""
# The lab template, less what only live widgets and JavaScript outputs need (require.js and
# mermaid, both from CDNs), plus the site's navigation and footer.
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block extra_css -%}<style>{{ resources.labkit_css }}</style>{%- endblock extra_css -%}
{%- block body_header -%}{{ super() }}
<nav class="labkit">{{ resources.labkit_nav }}</nav>
{%- endblock body_header -%}
{%- block body_footer -%}
<footer class="labkit">{{ resources.labkit_footer }}</footer>
{{ super() }}
{%- endblock body_footer -%}
"""


class SiteError(LabkitError):
    """The site cannot be built (no executed copies, say); the message says what to do."""


def _links(text: str) -> str:
    """Links to notebooks and to the cheat sheet, made links to their pages."""
    text = _NOTEBOOK_LINK.sub(lambda m: f'href="{m[1]}.html{m[2] or ""}"', text)
    return _CHEATSHEET_LINK.sub(lambda m: f'href="cheatsheet.html{m[1] or ""}"', text)


def _title(nb, fallback: str) -> str:
    """The notebook's first level-1 heading (the executed copy's own header has none)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def _page(title: str, nav: str, body: str) -> str:
    """A page of the site's own (the index, the cheat sheet)."""
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8" />\n'
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}{_PAGE_CSS}</style>\n</head>\n"
            f'<body>\n<nav class="labkit">{nav}</nav>\n<main>\n{body}\n</main>\n'
            f'<footer class="labkit">{_PAGE_FOOTER}</footer>\n</body>\n</html>\n')


def build(executed: Path = EXECUTED, out: Path = OUT, cheatsheet: Path = CHEATSHEET,
          images: Path = SOLUTIONS) -> list[Path]:
    """Write the site into ``out`` from the executed copies in ``executed``: the pages written,
    index first. A markdown cell's image is read from ``images`` (the solved notebooks' folder)
    and embedded. :class:`SiteError` if there are no copies or no cheat sheet."""
    import jinja2
    import mistune
    import nbformat
    from nbconvert import HTMLExporter

    paths = sorted(Path(executed).glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise SiteError(f"no executed notebooks in {executed}: the lab's test command writes "
                        f"them there (run `{TEST_COMMAND}` in the repository, or "
                        f"`{TEST_COMMAND} solutions/` for the solved notebooks only), then "
                        f"this command again")
    if not Path(cheatsheet).is_file():
        raise SiteError(f"no cheat sheet at {cheatsheet}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notebooks = [(p.stem, nbformat.read(p, as_version=4)) for p in paths]
    exporter = HTMLExporter(template_file="labkit_site.html.j2", embed_images=True,
                            extra_loaders=[jinja2.DictLoader({"labkit_site.html.j2": _TEMPLATE})])
    written, rows = [out / "index.html"], []
    for i, (name, nb) in enumerate(notebooks):
        title = _title(nb, name)
        nav = ['<a href="index.html">Lab index</a>', '<a href="cheatsheet.html">Cheat sheet</a>']
        if i > 0:
            nav.append(f'<a href="{notebooks[i - 1][0]}.html">← {notebooks[i - 1][0][:2]}</a>')
        if i + 1 < len(notebooks):
            nav.append(f'<a href="{notebooks[i + 1][0]}.html">{notebooks[i + 1][0][:2]} →</a>')
        nb.metadata["title"] = title
        body, _ = exporter.from_notebook_node(nb, resources={
            "metadata": {"name": name, "path": str(images)}, "labkit_css": _CSS,
            "labkit_nav": "".join(nav), "labkit_footer": _FOOTER})
        (out / f"{name}.html").write_text(_links(body), encoding="utf-8")
        written.append(out / f"{name}.html")
        run = next((c.metadata["labkit"]["executed"] for c in nb.cells
                    if "executed" in c.metadata.get("labkit", {})), None)
        ran = (f"ran {run['start'][:16].replace('T', ' ')} {run['start'][19:]}, "
               f"torch {run['torch']}"
               + (f"; failed: {', '.join(run['failed'])}" if run["failed"] else "")
               if run else "no record of its run")
        rows.append(f'<li><a href="{name}.html">{html.escape(title)}</a> '
                    f"<small>({html.escape(ran)})</small></li>")
    markdown = mistune.create_markdown(escape=False, plugins=["table", "strikethrough", "url"])
    sheet = _links(markdown(Path(cheatsheet).read_text(encoding="utf-8")))
    (out / "cheatsheet.html").write_text(
        _page("Cheat sheet and glossary", '<a href="index.html">Lab index</a>', sheet),
        encoding="utf-8")
    written.append(out / "cheatsheet.html")
    index = ("<h1>Distributed training with PyTorch: the reference run</h1>\n<p>Every lesson's "
             "solved notebook as the lab's tests ran it, outputs and figures included; "
             "each page's first cell says when, where and with which torch. Compare your own "
             "run with it: numbers and timings from another machine will differ.</p>\n<ul>\n"
             + "\n".join(rows) + '\n</ul>\n<p><a href="cheatsheet.html">The cheat sheet and '
             "glossary</a></p>")
    (out / "index.html").write_text(
        _page("The reference run", '<a href="cheatsheet.html">Cheat sheet</a>', index),
        encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit site [--executed DIR] [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="python -m labkit site",
        description="Render the executed copies of the solved notebooks (left by the lab's "
                    f"test command, `{TEST_COMMAND}`) and the cheat sheet as a static site.")
    parser.add_argument("--executed", type=Path, default=EXECUTED,
                        help=f"the executed copies (default: {EXECUTED.relative_to(_ROOT)})")
    parser.add_argument("--out", type=Path, default=OUT,
                        help=f"where the site goes (default: {OUT.relative_to(_ROOT)})")
    args = parser.parse_args(argv)
    try:
        pages = build(args.executed, args.out)
    except (SiteError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    missing = [les.notebook for les in syllabus.LESSONS
               if not (args.executed / f"{les.notebook}.ipynb").is_file()]
    if missing:
        print(f"note: no executed copy of {', '.join(missing)}: the links to them lead nowhere "
              f"(`{TEST_COMMAND} solutions/` writes every one)")
    print(f"wrote {len(pages)} pages; open {pages[0]}")
    return 0
