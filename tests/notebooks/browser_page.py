"""JupyterLab in a headless browser, the page side: run a notebook through the UI and check it.

:func:`check_notebook` opens one notebook of a running :class:`browser_helpers.Lab` (in a page
of :func:`new_page`, which serves one notebook after another), runs Run > Run All Cells, saves,
and returns a :class:`Report` whose ``problems`` name the cell and what went wrong. It clicks
what a learner clicks: the quiz forms (``labkit-quiz``: a wrong answer, then the bank's right
one) and the ring player (▶ and Play).
Screenshots go to ``artifacts/browser/<notebook>/``.

Example::

    page = new_page(browser)               # one tab: notebook after notebook
    report = check_notebook(lab, page, "notebooks/00_setup.ipynb")
    assert report.problems == [], report.problems
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from browser_helpers import ARTIFACTS

WIDGET = "application/vnd.jupyter.widget-view+json"
OPEN_S, RUN_S = 120.0, 420.0   # open + kernel start; run all cells


@dataclass
class Report:
    notebook: str
    problems: list[str] = field(default_factory=list)
    quizzes: int = 0              # quiz forms answered, feedback seen
    players: int = 0              # ring players that advanced on ▶ and Play
    images: int = 0               # plots rendered as loaded images
    timings: dict[str, float] = field(default_factory=dict)   # phase -> seconds
    slow_cells: list[tuple[int, float]] = field(default_factory=list)   # slowest first

    def summary(self) -> str:
        t = ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
        slow = ", ".join(f"cell {i} {s:.1f} s" for i, s in self.slow_cells[:5]) or "none"
        return (f"{self.notebook}: {t}; quizzes {self.quizzes}, players {self.players}, "
                f"images {self.images}; slowest cells: {slow}; problems: {len(self.problems)}")


def new_page(browser):
    """A browser page for :func:`check_notebook`; one page can serve many notebooks."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.set_default_timeout(30_000)
    return page


def check_notebook(lab, page, rel: str, slow_s: float = 10.0, as_readme: bool = False,
                   grade: bool = False, gone_s: float = 10.0) -> Report:
    """Open ``rel`` in JupyterLab, run every cell through the UI, check what rendered.

    ``as_readme``: open it the way the README's command does (the server's open-file page).
    ``grade``: then grade its live kernel as the grader would (an untouched student
    notebook must score zero, cleanly: :meth:`browser_helpers.Lab.grade_live`).
    ``gone_s``: how long the kernel's processes get to end after its shutdown.
    ``page`` (from :func:`new_page`): where JupyterLab already shows, the notebook opens the
    way a learner opens the next one (File > Open from Path...); its tab is closed at the end.
    """
    rep = Report(rel)
    shots = ARTIFACTS / Path(rel).stem
    shots.mkdir(parents=True, exist_ok=True)
    for old in shots.glob("*.png"):
        old.unlink()
    page_errors: list[str] = []
    on_error = lambda e: page_errors.append(str(e)[:300])   # noqa: E731
    page.on("pageerror", on_error)
    t0 = time.monotonic()
    try:
        panel = _open(page, lab, rel, as_readme, shots)
        rep.timings["open"] = time.monotonic() - t0
        t1 = time.monotonic()
        _run_all(page, panel, rel)
        rep.timings["run all"] = time.monotonic() - t1
        saved = _save_and_read(page, lab.root / rel)
        rep.problems += _saved_problems(saved)
        rep.slow_cells = _cell_times(saved)
        rep.problems += _dom_problems(panel)
        _screens(page, panel, shots)
        rep.images = _check_images(panel, saved, rep, shots)
        rep.quizzes = _check_quizzes(panel, rep, shots)
        rep.players = _check_players(panel, rep, shots)
        rep.problems += _progress_problems(panel, rep.slow_cells, slow_s)
        rep.problems += [p for p in _dom_problems(panel) if p not in rep.problems]
        rep.problems += [f"JavaScript error on the page: {e}" for e in page_errors
                         if "widget" in e.lower()]
        if grade:
            t2 = time.monotonic()
            problem = lab.grade_live(rel)
            rep.timings["grade"] = time.monotonic() - t2
            rep.problems += [f"grade: {problem}"] if problem else []
    except BaseException:                   # pytest-timeout's Failed too
        page.screenshot(path=str(shots / "FAILED.png"))
        print(lab.log_tail())
        page.goto("about:blank")            # the next notebook loads JupyterLab afresh
        raise
    finally:
        rep.timings["total"] = time.monotonic() - t0
        page.remove_listener("pageerror", on_error)
        if page.url != "about:blank":
            _close_tabs(page)
        try:
            left = lab.shutdown_kernels(within=gone_s)
        except Exception as exc:  # noqa: BLE001 - do not hide the failure being raised
            left = [f"(could not shut the kernel down: {exc})"]
        if left:
            rep.problems.append(f"processes outlived the kernel's shutdown: {left}")
    return rep


# ------------------------------------------------------------------ open, run, save
def _open(page, lab, rel: str, as_readme: bool, shots: Path):
    """The README's notebook opens from the page the server writes for a learner's browser;
    in a page that shows JupyterLab already, from File > Open from Path...; else by URL."""
    if not as_readme and page.url.startswith(lab.url().split("?")[0]):
        _menu(page, "File", r"^Open from Path")
        box = page.locator(".jp-Dialog input").first
        box.fill(lab.tree_path(rel))
        box.press("Enter")
    else:
        page.goto(lab.open_page() if as_readme else
                  lab.url(f"lab/tree/{lab.tree_path(rel)}", reset=""))
    tab = page.locator(".lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel", has_text=Path(rel).name)
    dialog = page.locator(".jp-Dialog-content")
    end = time.monotonic() + OPEN_S
    while not tab.first.is_visible():
        if dialog.first.is_visible():
            raise AssertionError(f"opening {rel}: JupyterLab says {dialog.first.inner_text()!r}")
        if time.monotonic() > end:
            raise AssertionError(f"{rel} did not open in JupyterLab within {OPEN_S:.0f} s")
        time.sleep(0.25)
    panel = page.locator(".jp-NotebookPanel:visible").first
    cells = len(json.loads((lab.root / rel).read_text())["cells"])
    ready = lambda: ((s := panel.evaluate(_PROMPTS))["cells"] == cells  # noqa: E731
                     and s["status"] == "idle" and _kernel_idle(lab, rel))
    end = time.monotonic() + OPEN_S
    while not (ready() and (time.sleep(1.0) or ready())):   # idle twice, a second apart
        if time.monotonic() > end:
            raise AssertionError(f"{rel}: the kernel was not ready within {OPEN_S:.0f} s "
                                 f"(toolbar says {panel.evaluate(_PROMPTS)['status']!r})")
        time.sleep(0.25)
    _dismiss_toasts(page)
    page.screenshot(path=str(shots / "00-opened.png"))
    return panel


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(item)).first.click()


def _close_tabs(page) -> None:
    """File > Close All Tabs (saved notebooks close without asking; their kernels stay up
    until :meth:`browser_helpers.Lab.shutdown_kernels`)."""
    _menu(page, "File", r"^Close All Tabs$")
    _wait(lambda: not page.locator(".jp-NotebookPanel:visible").count(), 10)
    if page.locator(".jp-NotebookPanel:visible").count():
        page.goto("about:blank")            # it would not close: start the next one afresh


def _kernel_idle(lab, rel: str) -> bool:
    path = lab.tree_path(rel)
    return any(x["path"] == path and (x.get("kernel") or {}).get("execution_state") == "idle"
               for x in lab.api("GET", "/api/sessions"))


def _dismiss_toasts(page) -> None:
    for button in page.locator(".jp-toast-button:visible", has_text="No").all():
        button.click()


_PROMPTS = """(panel) => {
    const ps = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
        .map(e => e.textContent.trim());
    const ind = panel.querySelector('.jp-Notebook-ExecutionIndicator');
    return {prompts: ps, status: ind ? ind.getAttribute('data-status') : null,
            cells: panel.querySelectorAll('.jp-Notebook .jp-Cell').length};
}"""


def _run_all(page, panel, rel: str) -> None:
    for attempt in range(3):
        _menu(page, "Run", r"^Run All Cells$")
        if _wait(lambda: any(p != "[ ]:" for p in panel.evaluate(_PROMPTS)["prompts"]), 15):
            break
        print(f"{rel}: Run All Cells started nothing (attempt {attempt + 1}); clicking again")
    end = time.monotonic() + RUN_S
    while time.monotonic() < end:
        state = panel.evaluate(_PROMPTS)
        ps = state["prompts"]
        busy = [i for i, p in enumerate(ps) if "*" in p]
        if ps and not busy and ps[0] != "[ ]:" and state["status"] == "idle":
            time.sleep(0.5)                 # let the last outputs and widget views land
            if panel.evaluate(_PROMPTS) == state:
                return
        time.sleep(0.5)
    raise AssertionError(f"{rel}: Run All Cells still running after {RUN_S:.0f} s "
                         f"(code cells still queued or running: {busy})")


def _save_and_read(page, path: Path) -> dict:
    before = path.stat().st_mtime_ns
    page.keyboard.press("Control+s")
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if path.stat().st_mtime_ns != before:
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass                        # caught mid-write
        time.sleep(0.2)
    raise AssertionError(f"Ctrl+S did not save {path.name} within 30 s")


# ------------------------------------------------------------------ what the saved file says
def _saved_problems(nb: dict) -> list[str]:
    out, raised = [], False
    for i, cell in enumerate(nb["cells"], 1):
        if cell["cell_type"] != "code" or not "".join(cell["source"]).strip():
            continue
        for o in cell.get("outputs", []):
            if o["output_type"] == "error":
                raised = True
                out.append(f"cell {i}: raised {o['ename']}: {o['evalue'][:300]} "
                           f"(source: {_first_line(cell)})")
        for o in cell.get("outputs", []):
            text = "".join(o.get("data", {}).get("text/plain", ""))
            if set(o.get("data", {})) == {"text/plain"} and re.match(r"<Figure size .*Axes>", text):
                out.append(f"cell {i}: a matplotlib Figure showed as the text {text!r}, not a "
                           f"plot: the inline backend was never activated (a pyplot figure or "
                           f"%matplotlib inline does it; `import matplotlib.pyplot` alone does "
                           f"not), or return a PNG (source: {_first_line(cell)})")
        if cell.get("execution_count") is None:
            why = "an earlier cell raised" if raised else "Run All Cells stopped before it"
            out.append(f"cell {i}: did not run ({why}; source: {_first_line(cell)})")
    return out


def _first_line(cell) -> str:
    return "".join(cell["source"]).strip().splitlines()[0][:80]


def _cell_times(nb: dict) -> list[tuple[int, float]]:
    """(cell number, seconds) from JupyterLab's recorded timings, slowest first."""
    def ts(s):
        return datetime.fromisoformat(s.replace("Z", "+00:00"))
    out = []
    for i, cell in enumerate(nb["cells"], 1):
        ex = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in ex and "shell.execute_reply" in ex:
            out.append((i, (ts(ex["shell.execute_reply"]) - ts(ex["iopub.execute_input"]))
                        .total_seconds()))
    return sorted(out, key=lambda x: -x[1])


def _png_outputs(nb: dict) -> int:
    return sum(1 for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}) and WIDGET not in o.get("data", {}))


# ------------------------------------------------------------------ what the page shows
def _dom_problems(panel) -> list[str]:
    text = panel.evaluate("""(p) => [...p.querySelectorAll('.jp-OutputArea-output')]
        .map(e => e.textContent).filter(t => t.includes('Error displaying widget'))
        .map(t => t.trim().slice(0, 200))""")
    return [f"widget failed to render: {t}" for t in dict.fromkeys(text)]


def _screens(page, panel, shots: Path) -> None:
    """The notebook one viewport at a time, top to bottom: the first page only, unless
    ``LABKIT_BROWSER_PAGES=N`` asks for up to N (a full tour costs ~15 s per notebook)."""
    most = int(os.environ.get("LABKIT_BROWSER_PAGES", "1"))
    scroller = panel.locator(".jp-WindowedPanel-outer").first
    height = scroller.evaluate("e => [e.scrollHeight, e.clientHeight]")
    for k in range(min(most, max(1, -(-height[0] // height[1])))):
        scroller.evaluate("(e, y) => { e.scrollTop = y; }", k * height[1])
        page.wait_for_timeout(300)
        page.screenshot(path=str(shots / f"01-page-{k + 1:02d}.png"))
    scroller.evaluate("e => { e.scrollTop = 0; }")


def _check_images(panel, saved: dict, rep: Report, shots: Path) -> int:
    imgs = panel.locator(".jp-RenderedImage img")
    n = imgs.count()
    for k in range(n):
        img = imgs.nth(k)
        img.scroll_into_view_if_needed()
        if not img.evaluate("e => e.complete && e.naturalWidth > 0"):
            rep.problems.append(f"plot image {k + 1} of {n} did not load in the browser")
        elif k < 4:
            img.screenshot(path=str(shots / f"03-plot-{k + 1}.png"))
    want = _png_outputs(saved)
    if n != want:
        rep.problems.append(f"{want} image outputs saved but {n} rendered as images")
    return n


# ------------------------------------------------------------------ quizzes
def _check_quizzes(panel, rep: Report, shots: Path) -> int:
    """Answer every quiz form: the first wrong then right, the rest right; feedback must show."""
    from labkit.grading.bank import find
    done = 0
    forms = panel.locator(".labkit-quiz")
    for k in range(forms.count()):
        form = forms.nth(k)
        form.scroll_into_view_if_needed()
        qid = form.locator(".widget-htmlmath-content b").first.text_content().strip()
        try:
            q = find(qid)
        except Exception as exc:  # noqa: BLE001 - reported, the other forms still get checked
            rep.problems.append(f"quiz form {k + 1} ({qid!r}): {exc}")
            continue
        submit = form.locator(".labkit-quiz-submit")
        if q.kind == "exercise":
            continue                        # an exercise form only points to lk.exercise.check
        tries = ([("wrong", _wrong(q))] if done == 0 and not q.key and _wrong(q) else []) + \
                [("correct" if not q.key else "", _right(q))]
        for want, answer in tries:
            _fill(form, q, answer)
            before = _feedback(form)
            submit.click()
            text = _wait(lambda: (t := _feedback(form)) != before and t, 15)
            if not text or not text.startswith(want):
                rep.problems.append(f"quiz {qid}: submitted {answer!r}, expected feedback "
                                    f"starting {want!r}, got {text!r}")
                break
        else:
            done += 1
            form.screenshot(path=str(shots / f"04-quiz-{qid}.png"))
    return done


def _right(q):
    if q.key:                               # computed from the learner's run: any answer will do
        return {"single": "a", "multi": "a", "numeric": "1"}.get(q.kind, "x")
    if q.kind == "single":
        return q.letters[q.choices.index(q.answer)]
    if q.kind == "multi":
        return "".join(l for l, c in zip(q.letters, q.choices) if c in q.answer)
    if q.kind == "short":
        return q.answer if isinstance(q.answer, str) else q.answer[0]
    return f"{q.answer:g}" if isinstance(q.answer, float) else str(q.answer)


def _wrong(q):
    if q.kind == "single" and len(q.choices) > 1:
        return next(l for l, c in zip(q.letters, q.choices) if c != q.answer)
    if q.kind == "numeric":
        return str(2 * abs(float(q.answer)) + 1000)
    if q.kind == "short":
        return "certainly not this"
    return None


def _fill(form, q, answer: str) -> None:
    if q.kind == "single":
        form.locator(".widget-radio-box label").nth(q.letters.index(answer)).click()
        _wait(lambda: form.locator("input[type=radio]").nth(q.letters.index(answer))
              .is_checked(), 5)
    elif q.kind == "multi":
        boxes = form.locator(".widget-checkbox input[type=checkbox]")
        for i, letter in enumerate(q.letters):
            boxes.nth(i).set_checked(letter in answer)
    else:
        box = form.locator("input[type=text]").first
        box.fill(answer)
        box.press("Tab")                    # ipywidgets Text syncs on change/blur too


def _feedback(form) -> str:
    return form.locator(".labkit-quiz-feedback").first.text_content().strip()


def _wait(fn, seconds: float, every: float = 0.2):
    end = time.monotonic() + seconds
    while True:
        value = fn()
        if value or time.monotonic() > end:
            return value
        time.sleep(every)


# ------------------------------------------------------------------ ring player
def _check_players(panel, rep: Report, shots: Path) -> int:
    """Every player (a Play widget next to a step slider) advances on ▶ and on Play."""
    ok = 0
    players = panel.locator(".jp-OutputArea-output:has(.widget-play)")
    for k in range(players.count()):
        pl = players.nth(k)
        pl.scroll_into_view_if_needed()
        state = lambda: pl.evaluate("""(e) => ({
            step: e.querySelector('.widget-readout')?.textContent.trim(),
            caption: [...e.querySelectorAll('.widget-html-content')].map(x => x.textContent).join('|'),
            images: [...e.querySelectorAll('img')].map(i => [i.src, i.complete && i.naturalWidth > 0])
        })""")  # noqa: E731
        s0 = state()
        name = f"player {k + 1}"
        if not s0["images"] or not all(ok_ for _, ok_ in s0["images"]):
            rep.problems.append(f"{name}: frame images missing or not loaded: {s0['images']}")
            continue
        pl.locator("button[title='step on'], button:text-is('▶')").first.click()
        _wait(lambda: state()["step"] != s0["step"], 20)
        s1 = _settled(state)                # the kernel redraws every image, then the caption
        new = [a[0] != b[0] for a, b in zip(s1["images"], s0["images"])]
        if s1["step"] != str(int(s0["step"]) + 1) or s1["caption"] == s0["caption"] or \
                not all(new):
            rep.problems.append(f"{name}: ▶ did not advance one step with a new caption and "
                                f"new frames (step {s0['step']!r} -> {s1['step']!r}, caption "
                                f"changed: {s1['caption'] != s0['caption']}, frames changed: "
                                f"{new})")
            continue
        pl.screenshot(path=str(shots / f"05-player{k + 1}-step{s1['step']}.png"))
        play = pl.locator(".widget-play button").first
        play.click()
        s2 = _wait(lambda: (s := state())["step"] and int(s["step"]) >= int(s1["step"]) + 2 and s,
                   30)
        pause = pl.locator(".widget-play button:has(i.fa-pause)")
        if pause.count():
            pause.first.click()             # still playing: pause (Play stops by itself at the end)
        if not s2:
            rep.problems.append(f"{name}: Play did not advance the frames "
                                f"(stuck at step {state()['step']})")
            continue
        s2 = _settled(state)                # the kernel redraws after the slider moved
        if re.search(r"step \d+ of", s2["caption"]) and int(s2["step"]) and \
                f"step {s2['step']} of" not in s2["caption"]:
            rep.problems.append(f"{name}: the slider says step {s2['step']} but the caption "
                                f"says {s2['caption'][:120]!r}")
            continue
        pl.screenshot(path=str(shots / f"05-player{k + 1}-played-to-step{s2['step']}.png"))
        ok += 1
    return ok


def _settled(state, quiet_s: float = 1.0, most_s: float = 10.0) -> dict:
    """The player's state once it has not changed for ``quiet_s``."""
    last, since, end = state(), time.monotonic(), time.monotonic() + most_s
    while time.monotonic() - since < quiet_s and time.monotonic() < end:
        time.sleep(0.2)
        now = state()
        if now != last:
            last, since = now, time.monotonic()
    return last


# ------------------------------------------------------------------ progress bars
def _progress_problems(panel, slow: list[tuple[int, float]], slow_s: float) -> list[str]:
    """A cell that ran longer than ``slow_s`` must show progress: a bar (a widget or tqdm
    text), or live logs streamed while it runs (torchrun's lines, timestamped by
    ``lk.torchrun``: ``  5.1s agent ...``, ``  6.0s rank 1 ...``)."""
    out = []
    for i, secs in slow:
        if secs <= slow_s:
            continue
        has_bar = panel.evaluate(r"""(p, i) => {
            const c = p.querySelector(`.jp-Cell[data-windowed-list-index="${i}"]`);
            if (!c) return null;
            const text = c.querySelector('.jp-OutputArea')?.textContent || '';
            const streamed = (text.match(/^ *\d+\.\ds (agent|rank|notebook)/gm) || []).length;
            return !!c.querySelector('.widget-hprogress, .widget-progress, progress') ||
                   /\d+%\|/.test(text) || streamed >= 3;
        }""", i - 1)
        if has_bar is None:
            out.append(f"cell {i}: ran {secs:.1f} s, but the page has no cell {i} to look at")
        elif not has_bar:
            out.append(f"cell {i}: ran {secs:.1f} s in the browser with no progress bar or live "
                       f"log (over {slow_s:g} s: show one, e.g. tqdm.auto)")
    return out
