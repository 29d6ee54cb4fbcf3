"""A notebook function as the main() of a torchrun script, and the exercise that grades one.

Notebook 05's exercise: turn a single-process training function into the
``main()`` of a torchrun DDP script. The learner writes ``train_ddp(epochs,
batch_size, lr)`` in a cell; :func:`run_function` ships it by value
(cloudpickle) into a real script that ``torchrun --nproc-per-node=2`` starts,
so it runs exactly as a file launched by torchrun would: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` ... in the environment, no process group until
the function makes one::

    res = lk.torchrun.run_function(train_ddp, kwargs={"epochs": 2, "batch_size": 32, "lr": 0.1})
    res.values[0]          # what rank 0 returned (a state_dict)

:func:`check_torchrun_exercise` (the bank's checker) launches it that way and
compares every rank with an oracle: one process training on the global batch,
visiting the samples in ``DistributedSampler(shuffle=True, seed=0)`` order.
A wrong answer is diagnosed against the usual mistakes (no ``set_epoch``, the
global batch on every rank, a scaled learning rate, no DDP wrap).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_function", "FunctionRun", "check_torchrun_exercise", "oracle", "EXERCISE_KWARGS"]

EXERCISE_KWARGS = {"epochs": 2, "batch_size": 32, "lr": 0.1}   # what the checker passes


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
    missing) raises :class:`labkit.torchrun.TorchrunFailed` naming the rank and
    its error; ``check=False`` returns the reports as they are.
    """
    import cloudpickle
    import torch

    from .torchrun import TorchrunFailed, run

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
    except NotImplementedError as exc:
        report.update(not_done=True, error=f"NotImplementedError: {exc}")
    except BaseException:  # noqa: BLE001  (the learner's error goes back to the notebook)
        report["error"] = traceback.format_exc()
        print(report["error"], file=sys.stderr, flush=True)
    import torch.distributed as dist

    report["pg_left"] = dist.is_available() and dist.is_initialized()
    report["stdout"] = out.getvalue()
    tmp = Path(out_dir) / f"rank{rank}.pt.tmp"
    torch.save(report, tmp)
    os.replace(tmp, Path(out_dir) / f"rank{rank}.pt")
    if report["pg_left"]:
        dist.destroy_process_group()
    return 0 if report["error"] is None else 1


# ---------------------------------------------------------------- the exercise
def oracle(epochs: int = 2, batch_size: int = 32, lr: float = 0.1, *, set_epoch: bool = True,
           momentum: float = 0.9) -> dict:
    """Final parameters of one process training on the global batch in DistributedSampler order.

    What a correct ``train_ddp(epochs, batch_size, lr)`` on any number of ranks
    must end with (up to float rounding): DDP averages the ranks' gradients, and
    the ranks' shards of step k together are exactly global batch k.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler

    from .train import make_dataset, make_model

    data = make_dataset()
    x, y = data.tensors
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    for epoch in range(epochs):
        order.set_epoch(epoch if set_epoch else 0)
        idx = torch.tensor(list(order))
        for k in range(0, len(idx), batch_size):
            b = idx[k:k + batch_size]
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    import torch

    diffs = [((a[k].float() - b[k].float()).abs().max().item(), k) for k in b
             if k in a and isinstance(a[k], torch.Tensor) and a[k].shape == b[k].shape]
    if len(diffs) != len(b):
        return float("inf"), next((k for k in b if k not in a), "shapes")
    return max(diffs)


_MISTAKES = [  # (what the learner probably did: oracle kwargs, why)
    (lambda kw, w: {**kw, "set_epoch": False},
     "every epoch repeats epoch 0's order: call sampler.set_epoch(epoch) at the start of each epoch"),
    (lambda kw, w: {**kw, "batch_size": kw["batch_size"] * w},
     "each rank used the whole batch_size, so the global batch grew world_size times: give the "
     "DataLoader batch_size // world_size"),
    (lambda kw, w: {**kw, "lr": kw["lr"] * w},
     "the learning rate was multiplied by the world size: DDP already averages the gradients, "
     "keep lr as it is"),
]


def check_torchrun_exercise(fn) -> list:
    """Checker for ``05.train_ddp``: launch ``fn`` with torchrun on 2 ranks and grade every rank."""
    from .exercise import case
    from .torchrun import TorchrunTimeout

    code = getattr(fn, "__code__", None)
    if code is not None and set(code.co_names) == {"NotImplementedError"}:
        raise NotImplementedError(f"{fn.__name__} is still the stub")
    kw, world = EXERCISE_KWARGS, 2
    try:
        res = run_function(fn, kwargs=kw, nproc_per_node=world, timeout=60, echo=False,
                           env={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    except TorchrunTimeout:
        res = None
    if res is not None and any(r.get("not_done") for r in res.reports):
        raise NotImplementedError(f"{fn.__name__} still raises NotImplementedError")
    reports = res.reports if res else []
    values = [r.get("value") for r in reports]
    kwtext = ", ".join(f"{k}={v}" for k, v in kw.items())

    def runs():
        assert res is not None, ("it did not finish within 60 s under torchrun: a deadlock? (a "
                                 "collective that only some ranks call, or init_process_group "
                                 "waiting for ranks that never come)")
        for r in reports:
            assert r.get("error") is None, (f"rank {r['rank']} failed: "
                                            f"{r['error'].strip().splitlines()[-1]}")
        for r in reports:
            v = r.get("value")
            assert isinstance(v, dict) and v, (f"rank {r['rank']} returned {type(v).__name__}, "
                                               f"not the model's state_dict(): return "
                                               f"model.module.state_dict() on every rank")
        return f"torchrun --nproc-per-node={world}, train_ddp({kwtext}), both ranks exit 0"

    def same():
        runs()
        d, name = _max_diff(values[0], values[1])
        assert d == 0.0, (f"rank 0 and rank 1 ended with different parameters (max |diff| "
                          f"{d:.2e} in {name}): their gradients were never averaged. Wrap the "
                          f"model: model = DistributedDataParallel(model)")

    def matches():
        runs()
        want = oracle(**kw)
        d, name = _max_diff(values[0], want)
        if d <= 1e-5:
            return f"max |diff| from one process on the global batch: {d:.1e}"
        for mistake, why in _MISTAKES:
            if _max_diff(values[0], oracle(**mistake(kw, world)))[0] <= 1e-5:
                raise AssertionError(f"the parameters are off (max |diff| {d:.2e} in {name}): {why}")
        raise AssertionError(
            f"the parameters differ from one process training on the global batch (max |diff| "
            f"{d:.2e} in {name}). Check: lk.train.make_model(dropout=0.0) and make_dataset(); "
            f"DistributedSampler(data, shuffle=True, seed=0) with set_epoch(epoch); per-rank "
            f"batch batch_size // world_size; SGD(lr, momentum=0.9); mean cross-entropy loss")

    def destroyed():
        runs()
        left = [r["rank"] for r in reports if r.get("pg_left")]
        assert not left, (f"rank(s) {left} returned with the process group still initialised: "
                          f"call dist.destroy_process_group() in a finally: block")

    def quiet():
        runs()
        noisy = [r for r in reports if r["rank"] != 0 and r.get("stdout", "").strip()]
        assert not noisy, (f"rank {noisy[0]['rank']} printed "
                           f"{noisy[0]['stdout'].strip().splitlines()[0]!r}: log only on rank 0 "
                           f"(if rank == 0: print(...))")

    return [case("runs under torchrun on 2 ranks", runs),
            case("every rank ends with the same parameters", same),
            case("equals one process on the global batch", matches),
            case("destroys the process group", destroyed),
            case("only rank 0 prints", quiet)]


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2]))
