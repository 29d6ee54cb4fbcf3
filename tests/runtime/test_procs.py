"""The one owner of the lab's processes (labkit/runtime/procs.py): a tree is found whole by its mark
(grandchildren in sessions of their own and orphans included) and stopped by one verb on every
path — its owner's stop, a time limit, the interpreter's exit — and no other module starts,
stops or reaps processes its own way."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from labkit.runtime import procs

LABKIT = Path(__file__).resolve().parents[2] / "labkit"
# sh: a grandchild in a session of its own, an orphan (its parent exits), and a child
_TREE_SH = "setsid sleep 120 & (sleep 120 &) ; exec sleep 120"


def _wait_for(pred, within: float = 10.0):
    end = time.monotonic() + within
    while not pred() and time.monotonic() < end:
        time.sleep(0.05)
    return pred()


def test_stop_kills_every_process_of_the_tree_and_reaps_its_root():
    tree = procs.Tree("test tree")
    root = tree.start(["sh", "-c", _TREE_SH], start_new_session=True)
    assert _wait_for(lambda: len(tree.live()) == 3), tree.live()
    pids = {p.pid for p in tree.live()}
    killed = tree.stop()
    assert root.returncode == -signal.SIGKILL                    # killed and reaped (no zombie)
    assert pids - {root.pid} <= set(killed) and tree.live() == []
    assert tree.token not in procs._trees and tree.token in procs.marks("test tree")
    assert tree.stop() == []                                      # again: nothing to do
    with pytest.raises(RuntimeError, match="was stopped"):
        tree.start(["true"])


def test_a_grace_lets_the_root_stop_on_its_own_signal():
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
              "print('ready', flush=True)\n"
              "time.sleep(120)\n")
    tree = procs.Tree("graceful")
    root = tree.start([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert root.stdout.readline().strip() == "ready"
    tree.stop(signal.SIGTERM, grace=10.0)
    root.stdout.close()
    assert root.returncode == 7                                   # it exited, was not killed


def test_stop_removes_the_tree_s_folders():
    folder = tempfile.mkdtemp(prefix="labkit-test-")
    tree = procs.Tree("with a folder", dirs=[folder])
    tree.stop()
    assert not os.path.exists(folder)


def test_a_tree_started_inside_a_tree_is_stopped_with_it():
    inner = ("import subprocess, sys, time\n"
             "from labkit.runtime import procs\n"
             "t = procs.Tree('inner')\n"
             "p = t.start(['sleep', '120'], start_new_session=True)\n"
             "print(t.token, p.pid, flush=True)\n"
             "time.sleep(120)\n")
    outer = procs.Tree("outer")
    try:
        root = outer.start([sys.executable, "-c", inner], stdout=subprocess.PIPE, text=True)
        token, pid = root.stdout.readline().split()
        root.stdout.close()
        assert token.startswith(outer.token + "/")                # the inner mark extends it
        assert int(pid) in {p.pid for p in outer.live()}          # even if it is still exec'ing
    finally:
        outer.stop()
    assert _wait_for(lambda: not psutil.pid_exists(int(pid)) or
                     psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE)


def test_a_process_seen_mid_exec_is_read_again(monkeypatch):
    """Popen returns once the child's exec passed its point of no return, before the new
    program's environment is set up: for that moment (long on a loaded machine) the child
    shows no environment at all. marked() reads it again instead of missing it."""
    class Execing:
        pid, reads = 424242, 0

        def status(self):
            return psutil.STATUS_RUNNING

        def ppid(self):
            return 1

        def create_time(self):
            return time.time() - 0.2          # forked a moment ago

        def environ(self):
            self.reads += 1
            return {} if self.reads < 3 else {procs.MARK: "outer/1.a"}

    child = Execing()
    monkeypatch.setattr(procs.psutil, "process_iter", lambda: iter([child]))
    assert procs.marked("outer") == [child] and child.reads == 3


def test_an_old_process_without_an_environment_is_not_waited_for(monkeypatch):
    """Chromium's zygotes run with an empty environment for their whole life; a learner's
    browser has them. Only a process created in the last _FRESH_S seconds can be mid-exec:
    an older empty one is read once and passed over (waiting for it cost every call 0.5 s)."""
    class Zygote:
        pid, reads = 434343, 0

        def status(self):
            return psutil.STATUS_SLEEPING

        def ppid(self):
            return 1

        def create_time(self):
            return time.time() - procs._FRESH_S - 60

        def environ(self):
            self.reads += 1
            return {}

    zygote = Zygote()
    monkeypatch.setattr(procs.psutil, "process_iter", lambda: iter([zygote]))
    assert procs.marked("outer") == [] and zygote.reads == 1


def test_run_stops_the_tree_at_its_time_limit():
    with pytest.raises(subprocess.TimeoutExpired):     # it stops waiting at the limit
        procs.run("slow", ["sh", "-c", _TREE_SH], 0.5)
    assert not procs.marked(procs.marks("slow"))                  # nothing it started is left
    code, out, _ = procs.run("quick", ["sh", "-c", "echo hi"], 30, stdout=subprocess.PIPE)
    assert (code, out) == (0, b"hi\n")


def test_an_interpreter_exit_stops_the_trees_it_did_not_stop():
    script = textwrap.dedent(f"""
        from labkit.runtime import procs
        t = procs.Tree("left running")
        t.start(["sh", "-c", {_TREE_SH!r}], start_new_session=True)
        import time
        end = time.monotonic() + 30
        while len(t.live()) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        print(t.token, len(t.live()), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    token, started = out[0], int(out[1])
    assert started == 3
    assert procs.marked(token) == []


def test_a_forked_child_s_exit_leaves_its_parent_s_trees_alone():
    script = textwrap.dedent("""
        import os, sys
        from labkit.runtime import procs
        t = procs.Tree("parent's")
        p = t.start(["sleep", "120"])
        child = os.fork()
        if child == 0:
            sys.exit(0)                                 # runs atexit: stop_all in the child
        os.waitpid(child, 0)
        alive = p.poll() is None
        t.stop()
        print(alive, p.returncode, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["True", str(-signal.SIGKILL)]


def test_kept_lists_live_pids_of_live_trees_only():
    tree = procs.Tree("keeps one")
    root = tree.start(["sleep", "120"])
    tree.kept.add(root.pid)
    assert root.pid in procs.kept() and root.pid in procs.ours()
    assert root.pid not in procs.ours(kept_too=False)
    tree.stop()
    assert root.pid not in procs.kept()


# Primitives that start, stop or reap processes; only procs.py uses them (zygote.py, the rank
# side, forks and reaps its own ranks: it is the fork server inside a tree).
_PRIMITIVES = re.compile(r"subprocess\.(Popen|run|call|check_call|check_output)\(|"
                         r"atexit\.register\(|os\.killpg\(|psutil\.wait_procs\(|"
                         r"\.send_signal\(|os\.fork\(|os\.waitpid\(")


def test_a_free_port_is_below_the_ephemeral_range_and_never_one_in_use(monkeypatch):
    """The rendezvous port is drawn where the kernel hands out no port (outgoing connections
    and bind(0) take theirs from the ephemeral range), and a port in use is skipped."""
    low = procs._ephemeral_low()
    ports = {procs.free_port() for _ in range(20)}
    assert all(procs._FIRST_CHOSEN_PORT <= p < low for p in ports), (ports, low)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(procs, "_FIRST_CHOSEN_PORT", taken)
        monkeypatch.setattr(procs, "_ephemeral_low", lambda: taken + 1001)
        draws, real = [taken, taken], procs.random.SystemRandom.randrange
        monkeypatch.setattr(procs.random.SystemRandom, "randrange",
                            lambda self, a, b: draws.pop() if draws else real(self, a, b))
        port = procs.free_port()
        assert draws == [] and port != taken and taken < port < taken + 1001


def test_no_module_but_procs_starts_stops_or_reaps_processes_its_own_way():
    found = []
    for path in sorted(LABKIT.rglob("*.py")):
        rel = path.relative_to(LABKIT).as_posix()
        if rel == "runtime/procs.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = _PRIMITIVES.search(line.split("#")[0])
            if m and not (rel == "runtime/zygote.py" and m.group().startswith("os.")):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == [], "process handling outside labkit/runtime/procs.py:\n" + "\n".join(found)


def test_a_dead_process_left_for_another_parent_to_reap_is_not_waited_for():
    """A killed rank whose launcher died first is reaped by init, which in a container may
    take seconds: stopping a tree waits until its processes are dead (a zombie is), not until
    someone else has reaped them (an exit of a script took 1.4-2 s more, one run in three)."""
    tree = procs.Tree("zombie maker")
    root = tree.start(["sh", "-c", "sleep 0 & exec sleep 120"])   # the child is never reaped
    parent = psutil.Process(root.pid)

    def zombie():
        kids = [c for c in parent.children() if c.status() == psutil.STATUS_ZOMBIE]
        return kids[0] if kids else None

    assert _wait_for(lambda: zombie() is not None), parent.children()
    z = zombie()
    done = threading.Event()
    threading.Thread(target=lambda: (procs._wait_dead([z], 600), done.set()), daemon=True).start()
    assert done.wait(60), "it waited for the zombie to be reaped by its parent"
    assert z.status() == psutil.STATUS_ZOMBIE          # still there: dead, not reaped
    tree.stop()
