"""A notebook function as the ``main()`` of a torchrun script (notebook 05's exercise runs this way).

:func:`run_function` ships ``fn`` by value (cloudpickle) into a real script that
``torchrun --standalone --nproc-per-node=N`` starts (this module's ``__main__``), so it runs
exactly as a file launched by torchrun would: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ... in
the environment, no process group until the function makes one. Each worker writes a report
(its return value as CPU tensors, its error, its output) that comes back to the caller::

    res = run_function(train_ddp, kwargs={"epochs": 2, "batch_size": 32, "lr": 0.1})
    res.values[0]          # what rank 0 returned (a state_dict)
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...portable.ending import exit_now, keep
from . import TorchrunFailed, run

__all__ = ["run_function", "FunctionRun"]


@dataclass
class FunctionRun:
    """What each rank of a :func:`run_function` job did (``reports[r]``: value, error, stdout ...)."""

    reports: list[dict]
    run: Any = field(repr=False)

    @property
    def values(self) -> list:
        return [r.get("value") for r in self.reports]

    @property
    def ok(self) -> bool:
        return self.run.ok and all(r.get("error") is None for r in self.reports)


def run_function(fn: Callable, *, kwargs: dict | None = None, nproc_per_node: int = 2,
                 timeout: float = 120.0, echo: bool | str = True, env: dict | None = None,
                 check: bool = True) -> FunctionRun:
    """Run ``fn(**kwargs)`` under ``torchrun --standalone --nproc-per-node=N`` as a script's main().

    Every rank's return value comes back (tensors and dicts of tensors), with
    its printed output. With ``check=True`` a rank that raised (or a rank
    missing) raises :class:`~labkit.runtime.torchrun.TorchrunFailed` naming the rank and
    its error; ``check=False`` returns the reports as they are.
    """
    import cloudpickle
    import torch

    with tempfile.TemporaryDirectory(prefix="labkit-fn-") as tmp:
        fn_path = Path(tmp) / "fn.pkl"
        fn_path.write_bytes(_dumps(cloudpickle, fn, dict(kwargs or {})))
        result = run(__name__, [str(fn_path), tmp], nproc_per_node=nproc_per_node,
                     timeout=timeout, echo=echo, env=env)
        reports = []
        for rank in range(nproc_per_node):
            path = Path(tmp) / f"rank{rank}.pt"
            reports.append(torch.load(path, weights_only=False) if path.exists() else
                           {"rank": rank, "error": "the worker ended without a report "
                                                  "(killed, or exited early)", "value": None})
    res = FunctionRun(reports, result)
    if check and not res.ok:
        bad = next((r for r in reports if r.get("error")), None)
        msg = (f"rank {bad['rank']} failed: {bad['error'].strip().splitlines()[-1]}" if bad else
               f"torchrun exited with {result.returncode}")
        raise TorchrunFailed(f"{msg}\n\n{bad['error'] if bad else result.tail()}", result)
    return res


def _dumps(cloudpickle, fn, kwargs) -> bytes:
    """Pickle ``fn`` by value unless the worker can import it (labkit, installed packages)."""
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(mod, "__file__", None) or ""
    by_value = (mod is not None and mod.__name__ != "__main__" and not mod.__name__.startswith(
        "labkit") and "site-packages" not in path)          # e.g. a test module, a local file
    if by_value:
        cloudpickle.register_pickle_by_value(mod)
    try:
        return cloudpickle.dumps((fn, kwargs))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(mod)


class _Tee(io.StringIO):
    def __init__(self, out):
        super().__init__()
        self._out = out

    def write(self, s: str) -> int:
        self._out.write(s)
        return super().write(s)


def _plain(value: Any) -> Any:
    """A rank's return value as CPU tensors (state_dict of a module; no "module." prefixes)."""
    import torch

    if isinstance(value, torch.nn.Module):
        value = getattr(value, "module", value).state_dict()
    if isinstance(value, dict):
        return {str(k).removeprefix("module."): (v.detach().cpu().clone()
                                                 if isinstance(v, torch.Tensor) else v)
                for k, v in value.items()}
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _worker(fn_path: str, out_dir: str) -> int:
    """One torchrun worker: load the function, call it, write a report for the parent."""
    import cloudpickle
    import torch

    rank = int(os.environ.get("RANK", "0"))
    report: dict = {"rank": rank, "error": None, "not_done": False, "value": None}
    out = _Tee(sys.stdout)
    try:
        fn, kwargs = cloudpickle.loads(Path(fn_path).read_bytes())
        with contextlib.redirect_stdout(out):
            report["value"] = _plain(fn(**kwargs))
    except BaseException as exc:  # noqa: BLE001  (the learner's error goes back to the notebook)
        keep(exc)   # never freed (exit_now ends the worker): freeing it can hang a worker
        if isinstance(exc, NotImplementedError):
            report.update(not_done=True, error=f"NotImplementedError: {exc}")
        else:
            report["error"] = traceback.format_exc()
            print(report["error"], file=sys.stderr, flush=True)
    import torch.distributed as dist

    report["pg_left"] = dist.is_available() and dist.is_initialized()
    report["stdout"] = out.getvalue()
    tmp = Path(out_dir) / f"rank{rank}.pt.tmp"
    torch.save(report, tmp)
    os.replace(tmp, Path(out_dir) / f"rank{rank}.pt")
    if rank == 0:
        _outlive_the_others(Path(out_dir), int(os.environ.get("WORLD_SIZE", "1")))
    if report["pg_left"]:
        dist.destroy_process_group()
    return 0 if report["error"] is None else 1


def _outlive_the_others(out_dir: Path, world_size: int) -> None:
    """Rank 0 leaves last: the lab's torchrun jobs run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    so rank 0's process hosts the job's TCPStore for as long as its group lives (a group the
    function did not destroy, or one DDP keeps alive: labkit/portable/ending.py), and a rank
    still reading from it would lose it if rank 0 destroyed the group or ended first. Every rank
    writes its report when its function has returned; a rank that dies instead makes the agent
    stop the group, this wait included. One that leaves without a report and without failing
    (``os._exit(0)`` in the function) is waited for ``OUTLIVE_S`` seconds at most."""
    end = time.monotonic() + OUTLIVE_S
    while time.monotonic() < end and not all((out_dir / f"rank{r}.pt").exists()
                                             for r in range(world_size)):
        time.sleep(0.02)


OUTLIVE_S = 30.0


if __name__ == "__main__":
    exit_now(_worker(sys.argv[1], sys.argv[2]))
