"""JupyterLab in a headless browser, as a learner gets it: the server side (issue 8).

:class:`Lab` starts the README's "open the lab" command (parsed from between the
``<!-- lab-command -->`` markers, ``.venv/bin/`` replaced by this interpreter's bin folder,
plus only ``--no-browser --port --ip --IdentityProvider.token --allow-root``) in a temporary
copy of the repository, because JupyterLab writes into the notebooks it runs. Every process
it starts (server, kernels, labkit launchers and ranks, Chromium) carries a marker in its
environment, so :meth:`Lab.leftovers` finds them even after they are re-parented, and
:meth:`Lab.stop` kills what is left by pid and reports it.

The page side (run all cells, quizzes, the ring player, plots) is ``browser_page.py``.

Example::

    with Lab(REPO) as lab:                 # the server; stopped, and checked for leftovers
        url = lab.url(f"lab/tree/{lab.tree_path('notebooks/00_setup.ipynb')}")
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil

from labkit.runtime.procs import free_port

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "browser"
MARKER = "LABKIT_BROWSER_TEST"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
# Run in the lab's environment but not as pytest's child: under PYTEST_CURRENT_TEST ipykernel
# drops child-process output, and conftest turns labkit's launcher prestart off.
_DROP_ENV = ("PYTEST_CURRENT_TEST", "LABKIT_PRESTART", "LABKIT_EXPECT_SOLVED", "JPY_SESSION_NAME")
# User state of the browser side, fresh for each run: no news toast, per-cell timings recorded
# (cell metadata only; nothing a learner sees changes).
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"recordTiming": True},
}


def chromium_path() -> str | None:
    """Debian's ``chromium-headless-shell`` (or ``$LABKIT_CHROMIUM``), None when missing."""
    exe = os.environ.get("LABKIT_CHROMIUM") or shutil.which("chromium-headless-shell")
    if not exe and os.path.exists("/usr/bin/chromium-headless-shell"):
        exe = "/usr/bin/chromium-headless-shell"
    return exe if exe and os.access(exe, os.X_OK) else None


def missing() -> list[str]:
    """Why the browser test cannot run on this machine (an empty list when it can)."""
    reasons = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reasons.append("the `playwright` Python package is not installed "
                       "(pip install -r requirements.txt)")
    if not chromium_path():
        reasons.append("chromium-headless-shell is not installed (run "
                       "`sh tests/install_browser.sh`, or set LABKIT_CHROMIUM to a Chromium binary)")
    return reasons


def lab_command(readme: Path = REPO / "README.md") -> list[str]:
    """The ``jupyter lab ...`` part of the README's lab command, run with this interpreter's env.

    >>> lab_command()[1:]
    ['lab', '--allow-root', '--ServerApp.root_dir=.', 'notebooks/00_setup.ipynb']
    """
    text = readme.read_text(encoding="utf-8")
    m = re.search(r"<!-- lab-command -->(.*?)<!-- /lab-command -->", text, re.S)
    if not m:
        raise AssertionError(f"{readme} has no <!-- lab-command --> ... <!-- /lab-command --> "
                             f"block: the browser test starts exactly the command inside it.")
    body = "\n".join(line for line in m.group(1).strip().splitlines()
                     if not line.startswith("```"))
    for part in body.replace("\\\n", " ").split("&&"):
        words = shlex.split(part)
        if len(words) >= 2 and Path(words[0]).name == "jupyter" and words[1] == "lab":
            exe = Path(sys.executable).parent / "jupyter"   # the venv's bin, symlinks kept
            if not exe.exists():
                raise AssertionError(f"{exe} is missing: install requirements.txt into the "
                                     f"environment that runs pytest ({sys.executable}).")
            return [str(exe)] + words[1:]
    raise AssertionError(f"the README's lab command has no `jupyter lab` step: {body!r}")


class Lab:
    """One JupyterLab server over a temporary copy of the repo, and cleanup of all it started."""

    def __init__(self, repo: Path = REPO, startup_s: float = 90.0) -> None:
        self.repo, self.startup_s = repo, startup_s
        self.tag = secrets.token_hex(6)
        self.token = secrets.token_hex(16)
        self.tmp = Path(tempfile.mkdtemp(prefix="labkit-browser-"))
        self.root = self.tmp / "repo"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.root_dir = self.root          # what the server serves (the README's command decides)
        self.command: list[str] = []

    # ---------------------------------------------------------------- start / stop
    def __enter__(self) -> "Lab":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        left = self.stop()
        if left and exc[0] is None:
            raise AssertionError(f"processes left after the browser test (killed): {left}")

    def start(self) -> None:
        shutil.copytree(self.repo, self.root, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "artifacts", "build", "__pycache__", ".pytest_cache",
            ".ipynb_checkpoints", "*.egg-info"))
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env[MARKER] = f"server-{self.tag}"
        for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                          ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                          ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")):
            env[name] = str(self.tmp / sub)
            (self.tmp / sub).mkdir()
        for rel, value in _SETTINGS.items():
            path = self.tmp / "settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        self.port = free_port()
        self.command = lab_command(self.root / "README.md") + [
            "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}", "--allow-root"]
        self.log = open(self.tmp / "lab.log", "w")
        self.proc = subprocess.Popen(self.command, cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        end = time.monotonic() + self.startup_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"`{shlex.join(self.command)}` exited with code "
                                     f"{self.proc.returncode}:\n{self.log_tail()}")
            for info in (self.tmp / "runtime").glob("jpserver-*.json"):
                try:
                    data = json.loads(info.read_text())
                    self.port, self.root_dir = data["port"], Path(data["root_dir"])
                    self.api("GET", "/api/status")
                    return
                except (OSError, ValueError, KeyError):
                    pass
            time.sleep(0.25)
        raise AssertionError(f"JupyterLab did not answer within {self.startup_s:.0f} s:\n"
                             f"{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((self.tmp / "lab.log").read_text().splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> list[str]:
        """Stop the server (it shuts its kernels down), then kill by pid anything still marked."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)   # jupyter_server: shut kernels down, exit
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = self.wait_gone(self.leftovers, within=10.0)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        if getattr(self, "log", None):
            self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return [_describe(p) for p in left]

    # ---------------------------------------------------------------- processes
    def marked(self, prefix: str = "") -> list[psutil.Process]:
        """Live processes whose environment carries this run's marker (``prefix`` narrows it)."""
        out = []
        for p in psutil.process_iter():
            try:
                tag = p.environ().get(MARKER, "")
                if tag.endswith(self.tag) and tag.startswith(prefix) and \
                        p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.Error, OSError):
                pass
        return out

    def leftovers(self) -> list[psutil.Process]:
        return self.marked()

    def kernel_processes(self) -> list[psutil.Process]:
        """Kernels and everything they started (labkit launchers, ranks): marked, not the server."""
        return [p for p in self.marked("server-") if self.proc is None or p.pid != self.proc.pid]

    @staticmethod
    def wait_gone(find, within: float) -> list[psutil.Process]:
        end = time.monotonic() + within
        left = find()
        while left and time.monotonic() < end:
            time.sleep(0.2)
            left = find()
        return left

    def chromium_env(self) -> dict:
        return {**os.environ, MARKER: f"chromium-{self.tag}"}

    # ---------------------------------------------------------------- server API
    def url(self, path: str = "", **query: str) -> str:
        q = "&".join([f"{k}={v}" if v else k for k, v in query.items()] + [f"token={self.token}"])
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}?{q}"

    def open_page(self) -> str:
        """The page the server writes for the learner's browser (a redirect to the README's file).

        ``jupyter lab FILE`` opens ``jpserver-file-to-run-PID-open.html`` (with the token, then a
        redirect to ``lab/tree/FILE``); ``--no-browser`` only skips starting a browser on it.
        """
        runtime = self.tmp / "runtime"
        pages = sorted(runtime.glob("jpserver-file-to-run-*-open.html")) or \
            sorted(runtime.glob("jpserver-*-open.html"))
        if not pages:
            raise AssertionError(f"JupyterLab wrote no open-in-browser page in {runtime}")
        return pages[0].as_uri()

    def tree_path(self, rel: str) -> str:
        """``rel`` (from the repo root) as the server sees it: relative to its root folder."""
        path = (self.root / rel).resolve()
        try:
            return path.relative_to(self.root_dir.resolve()).as_posix()
        except ValueError:
            raise AssertionError(f"the README's lab command serves {self.root_dir}, so a learner "
                                 f"cannot open {rel} from it") from None

    def api(self, method: str, path: str):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def grade_live(self, rel: str) -> str | None:
        """Grade notebook ``rel``'s live kernel exactly as the grader does (its bank, its key).

        Returns why the grade is wrong for an untouched student notebook (it must score zero,
        cleanly), or None. This is how the student notebooks are graded in the lab's test run:
        in the kernel JupyterLab ran them in, so each one executes once.
        """
        from jupyter_client import BlockingKernelClient

        from labkit.grading.grader import Options, grade_lesson_kernel

        path = self.tree_path(rel)
        ids = [s["kernel"]["id"] for s in self.api("GET", "/api/sessions") if s["path"] == path]
        if not ids:
            return f"{rel}: no kernel to grade (the notebook's session is gone)"
        kc = BlockingKernelClient(connection_file=str(self.tmp / "runtime" / f"kernel-{ids[0]}.json"))
        kc.load_connection_file()
        kc.start_channels()

        def run_cell(source):
            kc.execute_interactive(source, store_history=False, timeout=Options().collect_timeout,
                                   output_hook=lambda msg: None)
        try:
            kc.wait_for_ready(timeout=30)
            return grade_lesson_kernel(nbformat.read(self.root / rel, as_version=4), Path(rel),
                                       run_cell, solved=False)[1]
        finally:
            kc.stop_channels()

    def shutdown_kernels(self, within: float = 10.0) -> list[str]:
        """Shut every kernel down through the server; kill what outlives it and describe it."""
        for s in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{s['id']}")
        for k in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{k['id']}")
        left = self.wait_gone(self.kernel_processes, within)
        described = [_describe(p) for p in left]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        return described


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} {' '.join(p.cmdline())[:120]!r}"
    except psutil.Error:
        return f"pid {p.pid}"
