"""Real NCCL failure logs: capture them on a GPU machine, show them where there is none.

Notebook 04 §9 runs NCCL's watchdog live on a machine with 2 GPUs. Elsewhere it
shows logs captured on a real GPU machine by this module, each file headed by
where and when it was captured, with which torch, NCCL and GPU, and the command.
Nothing is shown that did not come from such a run::

    python -m labkit nccl-capture                 # on a GPU machine: every scenario that fits
    python -m labkit nccl-capture busy_gpu --out DIR

The scenarios are the script :mod:`labkit.pitfalls.nccl_faults`, run under
torchrun (:mod:`labkit.runtime.torchrun`) with ``NCCL_DEBUG=INFO``, the flight recorder
on and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``. A capture file holds the header, every
line of the job as :class:`labkit.runtime.torchrun.log.Run` records it (seconds since start,
who printed it, the text), and a summary of each flight-recorder dump written.
Stored captures live in ``labkit/captures/nccl/`` (committed with the lab).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import pickle
import platform
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..runtime.errors import LabkitError
from .nccl_faults import GPUS_NEEDED, SCENARIOS

CAPTURE_DIR = Path(__file__).parent / "captures" / "nccl"
SCRIPT = "labkit.pitfalls.nccl_faults"
ENV = {"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "64"}
DUMPS = "## flight-recorder dumps"
HEADER_KEYS = ("scenario", "captured", "backend", "torch", "nccl", "gpus", "python", "command",
               "env", "exit", "wall_s")
# what the notebook's excerpt keeps of a log (the whole file stays on disk to read)
_EXCERPT = re.compile(r"NCCL WARN|[Ww]atchdog|ProcessGroupNCCL|timed out|Timeout|Duplicate GPU|"
                      r"process down|\w+Error: |[Ff]light recorder|dump|exitcode|^ *[\d.]+s rank \d+ +rank \d+: ")


class CaptureError(LabkitError):
    """A capture could not be made here (no GPUs, too few, unknown scenario)."""


def capture(scenario: str, out_dir: str | os.PathLike = CAPTURE_DIR, *, backend: str = "nccl",
            timeout: float = 5.0, echo: bool = False) -> Path:
    """Run one scenario under torchrun and write ``<out_dir>/<scenario>.log``; return its path.

    ``backend="gloo"`` runs ``skipped`` on the CPU: the same plumbing, gloo's
    messages (for trying the tool, and for its tests). ``echo`` streams the job's
    lines as they come.
    """
    from ..runtime import torchrun

    if scenario not in SCENARIOS:
        raise CaptureError(f"no scenario {scenario!r}; choose from {sorted(SCENARIOS)}.")
    machine = _machine()
    if backend == "nccl" and machine["gpu_count"] < GPUS_NEEDED[scenario]:
        raise CaptureError(f"{scenario} needs {GPUS_NEEDED[scenario]} CUDA GPU(s); this machine "
                           f"has {machine['gpu_count']}. Run it on a GPU machine, or try "
                           f"`skipped` on the CPU with backend='gloo'.")
    dumps = tempfile.mkdtemp(prefix="labkit-fr-")
    env = {**ENV, "TORCH_FR_DUMP_TEMP_FILE": f"{dumps}/rank_"}   # the dump files' prefix
    args = [scenario, "--timeout", str(timeout), "--backend", backend]
    try:
        run = torchrun.run(SCRIPT, args, nproc_per_node=SCENARIOS[scenario], env=env,
                           echo=echo, timeout=timeout + 120.0)
        records = [_flight_summary(p) for p in sorted(glob.glob(f"{dumps}/rank_*"))]
    finally:
        shutil.rmtree(dumps, ignore_errors=True)
    shown_env = " ".join(f"{k}={v}" for k, v in {**torchrun.AGENT_ENV, **env}.items())
    header = {
        "scenario": scenario,
        "captured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": backend, "torch": machine["torch"], "nccl": machine["nccl"],
        "gpus": machine["gpus"], "python": platform.python_version(),
        "command": "torchrun " + " ".join(run.cmds[0][3:]),   # as run, after "python -m ..."
        "env": shown_env, "exit": str(run.returncodes), "wall_s": f"{run.wall_s:.1f}"}
    body = ["# " + f"{k}: {header[k]}" for k in HEADER_KEYS]
    body += ["", "## the job's lines (seconds since start, who printed, text)", run.log("all"),
             "", f"{DUMPS} ({len(records)})"]
    body += records or ["(none was written)"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{scenario}.log"
    path.write_text("\n".join(body) + "\n")
    return path


def _machine() -> dict:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if n else "-"
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    gpus = (f"{n} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)) if n else "none"
    return {"gpu_count": n, "gpus": gpus, "torch": torch.__version__, "nccl": nccl}


def _flight_summary(path: str) -> str:
    """One dump file, as lines: which rank, then each recorded collective and its state."""
    with open(path, "rb") as f:
        dump = pickle.load(f)       # written by this run's own ranks
    lines = [f"{os.path.basename(path)}: version {dump.get('version', '?')}, "
             f"{len(dump.get('entries', []))} entries"]
    for e in dump.get("entries", []):
        lines.append(f"  seq {e.get('collective_seq_id', '?'):>3} {e.get('profiling_name', '?'):<22} "
                     f"sizes {e.get('input_sizes', '?')} state {e.get('state', '?')}")
    for pg, status in (dump.get("pg_status") or {}).items():
        lines.append(f"  pg {pg} status: {status}")
    return "\n".join(lines)


@dataclass
class Capture:
    """One stored capture: its header fields and the whole log text."""

    path: Path
    header: dict
    text: str

    def excerpt(self, info_lines: int = 4) -> str:
        """The header, the first NCCL INFO lines, every line about the failure, the dumps."""
        head = [f"{k:>8}: {self.header[k]}" for k in HEADER_KEYS if k != "env"]
        log, _, dumps = self.text.partition(DUMPS)
        log = [ln for ln in log.splitlines() if not ln.startswith("#")]
        info = [ln for ln in log if "NCCL INFO" in ln][:info_lines]
        rest = [ln for ln in log if "NCCL INFO" not in ln and _EXCERPT.search(ln)]
        return "\n".join(head + (["  ..."] + info if info else []) + ["  ..."] + rest
                         + [DUMPS + dumps.rstrip()])


def load(path: str | os.PathLike) -> Capture:
    """One capture file, checked for a complete header."""
    path = Path(path)
    text = path.read_text()
    header = dict(m.groups() for m in re.finditer(r"^# (\w+): (.*)$", text, re.M))
    missing = [k for k in HEADER_KEYS if k not in header]
    if missing:
        raise CaptureError(f"{path} is not a labkit capture (no {', '.join(missing)} in its "
                           f"header): make it with `python -m labkit nccl-capture` on a GPU "
                           f"machine, or remove it.")
    return Capture(path, header, text)


def stored(directory: str | os.PathLike = CAPTURE_DIR) -> list[Capture]:
    """The captures in ``directory`` (``*.log``)."""
    return [load(p) for p in sorted(Path(directory).glob("*.log"))]


def show(directory: str | os.PathLike = CAPTURE_DIR) -> list[Capture]:
    """Print each stored capture's excerpt, labelled as a capture; say so when there is none."""
    caps = stored(directory)
    if not caps:
        print(f"No NCCL capture is stored in this copy of the lab ({directory}). On a machine "
              f"with a CUDA GPU, `python -m labkit nccl-capture` records them; until then this "
              f"notebook shows no NCCL output at all rather than invented lines.")
    for c in caps:
        print(f"===== CAPTURED LOG, not a live run: {c.header['scenario']} — recorded "
              f"{c.header['captured']} on {c.header['gpus']} (full file: {c.path.name}) =====")
        print(c.excerpt())
        print()
    return caps


def live(names: list[str] | tuple = ("busy_gpu", "same_device"), *, backend: str = "nccl",
         timeout: float = 5.0) -> list[Capture]:
    """Run scenarios here and now (one GPU fits the default two), streaming their lines.

    Each job's lines are printed as they come, then its flight-recorder dumps;
    the captures are returned (their files are in a temporary folder, removed).
    """
    out = []
    with tempfile.TemporaryDirectory(prefix="labkit-nccl-live-") as tmp:
        for name in names:
            print(f"===== LIVE run on this machine: {name} ({backend}) =====", flush=True)
            cap = load(capture(name, tmp, backend=backend, timeout=timeout, echo=True))
            print(f"torchrun exit codes {cap.header['exit']} after {cap.header['wall_s']} s")
            print(DUMPS + cap.text.partition(DUMPS)[2])
            out.append(cap)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit nccl-capture",
                                description="Capture real NCCL failure logs on a GPU machine.")
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                   help=f"any of {sorted(SCENARIOS)}; default: every one this machine's GPUs fit")
    p.add_argument("--out", default=str(CAPTURE_DIR), help="folder for the .log files")
    p.add_argument("--timeout", type=float, default=5.0, help="process-group timeout, seconds")
    a = p.parse_args(argv)
    gpus = _machine()["gpu_count"]
    if gpus == 0:
        print("error: this machine has no CUDA GPU, and NCCL needs one. Run `python -m "
              "labkit nccl-capture` on a GPU machine (2 GPUs for every scenario, 1 for "
              "busy_gpu and same_device).", file=sys.stderr)
        return 2
    names = a.scenarios or [s for s in SCENARIOS if GPUS_NEEDED[s] <= gpus]
    try:
        for name in names:
            path = capture(name, a.out, timeout=a.timeout)
            print(f"{name}: wrote {path}")
    except CaptureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
