"""How the lab's rank scripts end (``labkit/portable/ending.py``): Python's exit codes and exit
work, without the interpreter's teardown."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

_SCRIPT = """
import atexit, logging, sys
from labkit.portable.ending import run_then_exit

class Finalized:
    def __del__(self):
        print("freed", file=sys.stderr, flush=True)

logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
atexit.register(lambda: print("atexit ran"))

def main():
    print("buffered, never flushed by main")
    logging.info("logged")
{body}

run_then_exit(main)
print("not reached")
"""


def _run(tmp_path, body):
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT.format(body=textwrap.indent(textwrap.dedent(body), "    ")))
    log = tmp_path / "log.txt"
    out = subprocess.run([sys.executable, str(script), "x", str(log)], capture_output=True,
                         text=True, timeout=50)
    return out, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("body, code, err", [
    ("return None", 0, ""),
    ("return 3", 3, ""),
    ("sys.exit(4)", 4, ""),
    ("sys.exit()", 0, ""),
    ("sys.exit('bye')", 1, "bye"),
    ("raise ValueError('bad value')", 1, "ValueError: bad value"),
    ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
])
def test_a_script_ends_with_pythons_exit_code_and_its_exit_work_done(tmp_path, body, code, err):
    out, log = _run(tmp_path, body)
    assert out.returncode == code, out.stderr
    assert err in out.stderr
    if err.startswith(("ValueError", "KeyboardInterrupt")):
        assert "Traceback (most recent call last)" in out.stderr
    assert "buffered, never flushed by main" in out.stdout      # stdout is a pipe: buffered
    assert "atexit ran" in out.stdout
    assert "not reached" not in out.stdout
    assert "INFO:root:logged" in log


@pytest.mark.parametrize("body", ["raise ValueError('bad value')", "sys.exit(4)",
                                  "raise KeyboardInterrupt"])
def test_the_exception_a_script_ends_with_is_never_freed(tmp_path, body):
    """Freeing it frees its traceback's frames and what they hold: a DDP model whose Reducer
    holds the last reference to a gloo group, destroyed with the GIL held while a gloo thread
    waits for the GIL (a rank that never exits: ending.py). The frame's objects outlive the
    exit work and are never finalized."""
    out, _ = _run(tmp_path, f"held = Finalized()\n{body}")
    assert "atexit ran" in out.stdout
    assert "freed" not in out.stderr, out.stderr


def test_exit_now_skips_the_interpreters_teardown(tmp_path):
    """What the module is for: no finalization (an object's __del__ at teardown never runs)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        from labkit.portable.ending import exit_now
        class Finalized:
            def __del__(self):
                print("finalized")
        kept = Finalized()
        print("ending")
        exit_now(5)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=50)
    assert (out.returncode, out.stdout) == (5, "ending\n")


@pytest.mark.parametrize("ending", ["python", "run_then_exit"])
def test_threads_finish_hooks_report_and_a_failed_flush_is_120_as_in_python(tmp_path, ending):
    """What the interpreter does before it finalizes, done the same way: a non-daemon thread
    and a pending executor job finish, the exception goes through sys.excepthook, and a
    standard stream that cannot be flushed (/dev/full) makes the exit code 120."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from pathlib import Path
        from labkit.portable.ending import run_then_exit
        out = Path(sys.argv[1])

        def late(name):
            time.sleep(0.3)
            (out / name).write_text("done")

        def main():
            threading.Thread(target=late, args=("thread",)).start()
            ThreadPoolExecutor(1).submit(late, "executor")
            sys.excepthook = lambda *exc: print("HOOK", exc[0].__name__, file=sys.stderr)
            if sys.argv[2] == "full":
                sys.stdout = open("/dev/full", "w")
                print("lost")
            raise ValueError("x")

        if {ending == "python"!r}:
            main()
        else:
            run_then_exit(main)
    """))
    for stdout, code in (("ok", 1), ("full", 120)):
        out = subprocess.run([sys.executable, str(script), str(tmp_path), stdout],
                             capture_output=True, text=True, timeout=50)
        assert out.returncode == code, out.stderr
        assert "HOOK ValueError" in out.stderr
        assert (tmp_path / "thread").read_text() == "done"
        assert (tmp_path / "executor").read_text() == "done"
        (tmp_path / "thread").unlink(), (tmp_path / "executor").unlink()
