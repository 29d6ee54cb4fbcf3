"""The checker of notebook 05's exercise, its oracle, and the lesson's quiz key (the core
build's checker, ``05.torchrun_lines``, is :mod:`labkit.torchrun.check.lines`).

The exercise: turn a single-process training function into the ``main()`` of a torchrun DDP
script. :func:`check_torchrun_exercise` (the bank's checker) launches the learner's
``train_ddp(epochs, batch_size, lr)`` with ``torchrun --nproc-per-node=2``
(:func:`labkit.runtime.torchrun.function.run_function`) and compares every rank with an oracle:
one process training on the global batch, visiting the samples in
``DistributedSampler(shuffle=True, seed=0)`` order. A wrong answer is diagnosed against the
usual mistakes (no ``set_epoch``, the global batch on every rank, a scaled learning rate, no
DDP wrap). Equal numbers are not enough, since one process training alone in each worker
ends with them too: each worker also reports (:func:`_watched`) the DistributedSampler it
built and the collectives gloo ran for it (its flight recorder: see
:mod:`labkit.grading.watch`), so a worker must shard the data and all-reduce every
gradient every step (from any thread: the recorder is the process's); the other cases count
only for such a run. Counts alone pass decoys (zeros all-reduced beside a result copied from
the oracle), so each worker's DistributedDataParallel also reports what it all-reduced, per
step (:func:`_ddp_problem`): the sum of squares of its own shard's gradients along the
training's trajectory, which only the real work produces. :func:`reference` is the
uninterrupted run a restarted one is compared with.
"""
from __future__ import annotations

import functools
import math

from ...grading.exercise import case
from ...runtime import run
from ...runtime.torchrun import TorchrunTimeout
from ...runtime.torchrun.function import run_function
from ...runtime.torchrun.log import Run
from ..runs import resumes
from ..train import make_dataset, make_model, parse_args, train

__all__ = ["check_torchrun_exercise", "oracle", "reference", "last_resume_step",
           "EXERCISE_KWARGS"]

EXERCISE_KWARGS = {"epochs": 2, "batch_size": 32, "lr": 0.1}   # what the checker passes
LIMIT_S = 120.0   # one launch of the answer: ~15 s alone on 2 cores, several times that when busy


def oracle(epochs: int = 2, batch_size: int = 32, lr: float = 0.1, *, set_epoch: bool = True,
           momentum: float = 0.9, local: list | None = None, world: int = 2) -> dict:
    """Final parameters of one process training on the global batch in DistributedSampler order.

    What a correct ``train_ddp(epochs, batch_size, lr)`` on any number of ranks
    must end with (up to float rounding): DDP averages the ranks' gradients, and
    the ranks' shards of step k together are exactly global batch k (rank r's batch is
    ``b[r::world]`` of global batch ``b``). ``local``, if given, gets one row per step: the sum
    of squares of each of ``world`` ranks' own gradient, what its DDP all-reduces.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler

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
            if local is not None:
                local.append([_sumsq(torch.autograd.grad(
                    F.cross_entropy(model(x[b[r::world]]), y[b[r::world]]),
                    list(model.parameters()))) for r in range(world)])
            loss = F.cross_entropy(model(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.lru_cache(maxsize=8)
def _trajectory(world: int, **kw) -> tuple[dict, list]:
    """``oracle(**kw)``'s final parameters and its per-step local gradients (cached: the
    checker asks for the same few runs in several cases)."""
    local: list = []
    return oracle(**kw, local=local, world=world), local


def _sumsq(tensors) -> float:
    return float(sum(t.detach().double().square().sum() for t in tensors))


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


def _watched(fn, kwargs: dict) -> dict:
    """Runs in each torchrun worker: the learner's function, and what it did to shard and sync.

    Returns ``{"value": its state_dict, "samplers": [{"replicas", "rank", "epochs"}],
    "collectives": [(name, elements), ...], "ddp_steps": [sum of squares, ...]}``: per step,
    what every DistributedDataParallel it built all-reduced (a comm hook of the checker's that
    runs torch's default ``allreduce_hook``; an answer that registers its own comm hook fails).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    from ...grading.watch import last_record_id, recorded
    from ...runtime.torchrun.function import _plain

    samplers: list[dict] = []
    init, iterate = DistributedSampler.__init__, DistributedSampler.__iter__
    ddp_init, steps = DDP.__init__, []

    def watched_ddp(self, *args, **kw):     # the default all-reduce, noting what it carried
        ddp_init(self, *args, **kw)

        def carried(state, bucket):
            if bucket.index() == 0 or not steps:
                steps.append(0.0)           # the reducer launches bucket 0 first, each step
            steps[-1] += _sumsq([bucket.buffer()])
            return allreduce_hook(state, bucket)
        self.register_comm_hook(None, carried)

    def watched_init(self, *args, **kw):
        init(self, *args, **kw)
        self._labkit_seen = {"replicas": self.num_replicas, "rank": self.rank, "epochs": []}
        samplers.append(self._labkit_seen)

    def watched_iter(self):
        getattr(self, "_labkit_seen", {"epochs": []})["epochs"].append(self.epoch)
        return iterate(self)

    DistributedSampler.__init__, DistributedSampler.__iter__ = watched_init, watched_iter
    DDP.__init__ = watched_ddp
    mark = last_record_id()
    try:
        value = _plain(fn(**kwargs))
    finally:
        DistributedSampler.__init__, DistributedSampler.__iter__ = init, iterate
        DDP.__init__ = ddp_init
    return {"value": value, "samplers": samplers, "collectives": recorded(mark),
            "ddp_steps": steps}


def _sync_problem(report: dict, world: int, kw: dict) -> str | None:
    """Why this worker did not train data-parallel: no shard of its own, or gradients unsynced."""
    rank, seen = report["rank"], report.get("value") or {}
    mine = [s for s in seen.get("samplers", []) if (s["replicas"], s["rank"]) == (world, rank)]
    if not mine:
        built = [(s["replicas"], s["rank"]) for s in seen.get("samplers", [])]
        return (f"rank {rank} built no DistributedSampler(num_replicas={world}, rank={rank})"
                f"{f' (only {built})' if built else ''}: each rank must train on its own shard "
                f"of the data, not the whole dataset")
    per_rank = math.ceil(len(make_dataset()) / world)
    steps = kw["epochs"] * math.ceil(per_rank / (kw["batch_size"] // world))
    params = sum(p.numel() for p in make_model(dropout=0.0).parameters())
    reduced = sum(n for name, n in seen.get("collectives", []) if name == "gloo:all_reduce")
    if reduced < steps * params:
        return (f"rank {rank} all-reduced {reduced} elements in all; averaging all {params} "
                f"gradients in each of the {steps} steps takes at least {steps * params} "
                f"(gradients averaged any other way, through a side channel such as the process "
                f"group's TCPStore or a file, do not count). Wrap the model: "
                f"DistributedDataParallel(model) all-reduces them during backward")
    return None


def _ddp_problem(reports: list[dict], world: int, kw: dict) -> str | None:
    """Did every worker's DDP all-reduce its own shard's gradients, every step, along one of the
    trajectories its result could come from (the right one, or one of the usual mistakes)?
    Counts alone pass decoys: zeros all-reduced while the result is copied from elsewhere."""
    got = {r["rank"]: (r.get("value") or {}).get("ddp_steps") or [] for r in reports}
    for rank, steps in got.items():
        if not steps:
            return (f"rank {rank} wrapped no model in DistributedDataParallel, so what it "
                    f"all-reduced cannot be tied to its gradients (decoy all-reduces beside a "
                    f"result copied from elsewhere pass every count). Wrap the model: "
                    f"DistributedDataParallel(model)")
    why = ""
    for make in [lambda kw, w: kw] + [m for m, _ in _MISTAKES]:
        local = _trajectory(world, **make(kw, world))[1]
        for rank, steps in got.items():
            want = [row[rank] for row in local]
            bad = next((k for k, (g, w) in enumerate(zip(steps, want))
                        if abs(g - w) > 1e-3 * w + 1e-12), None)
            if bad is not None or len(steps) != len(want):
                why = why or (
                    f"rank {rank}: it synchronised {len(steps)} steps, the training has "
                    f"{len(want)}" if bad is None else
                    f"rank {rank}, step {bad}: their sum of squares is {steps[bad]:.6g}, its "
                    f"shard's gradients' {want[bad]:.6g}")
                break
        else:
            return None
    return (f"the gradients a DistributedDataParallel all-reduced are not those of the model on "
            f"the rank's own shard ({why}): every step must backpropagate the mean "
            f"cross-entropy of this rank's batch through the wrapped model it returns")


def check_torchrun_exercise(fn) -> list:
    """Checker for ``05.train_ddp``: launch ``fn`` with torchrun on 2 ranks and grade every rank."""
    code = getattr(fn, "__code__", None)
    if code is not None and set(code.co_names) == {"NotImplementedError"}:
        raise NotImplementedError(f"{fn.__name__} is still the stub")
    kw, world = EXERCISE_KWARGS, 2

    def train_ddp_watched(**kwargs):          # what each torchrun worker runs
        return _watched(fn, kwargs)
    # run_function ships a function's own module by value when workers cannot import it (a
    # test file): let it decide for the learner's function, not for this wrapper
    train_ddp_watched.__module__ = getattr(fn, "__module__", __name__)

    try:
        res = run_function(train_ddp_watched, kwargs=kw, nproc_per_node=world, timeout=LIMIT_S,
                           echo=False, env={"CUDA_VISIBLE_DEVICES": ""}, check=False)
    except TorchrunTimeout as exc:
        res, last = None, "\n".join(ln.format() for ln in exc.last) or "(none)"
    if res is not None and any(r.get("not_done") for r in res.reports):
        raise NotImplementedError(f"{fn.__name__} still raises NotImplementedError")
    reports = res.reports if res else []
    values = [(r.get("value") or {}).get("value") for r in reports]
    kwtext = ", ".join(f"{k}={v}" for k, v in kw.items())

    def runs():
        assert res is not None, (f"it did not finish within {LIMIT_S:.0f} s under torchrun: a "
                                 "deadlock? (a collective that only some ranks call, or "
                                 "init_process_group waiting for ranks that never come). Its "
                                 f"last lines:\n{last}")
        for r in reports:
            assert r.get("error") is None, (f"rank {r['rank']} failed: "
                                            f"{r['error'].strip().splitlines()[-1]}")
        for r, v in zip(reports, values):
            assert isinstance(v, dict) and v, (f"rank {r['rank']} returned {type(v).__name__}, "
                                               f"not the model's state_dict(): return "
                                               f"model.module.state_dict() on every rank")
        return f"torchrun --nproc-per-node={world}, train_ddp({kwtext}), both ranks exit 0"

    @functools.cache
    def sync_problem() -> str | None:
        return next((p for p in (_sync_problem(r, world, kw) for r in reports) if p), None) \
            or _ddp_problem(reports, world, kw)

    def data_parallel():
        """The other cases grade a data-parallel script: one process alone passes them idly."""
        runs()
        if sync_problem():
            raise AssertionError("not counted: the workers did not train data-parallel (see "
                                 "'shards the data and all-reduces the gradients')")

    def same():
        data_parallel()
        d, name = _max_diff(values[0], values[1])
        assert d == 0.0, (f"rank 0 and rank 1 ended with different parameters (max |diff| "
                          f"{d:.2e} in {name}): their gradients were never averaged. Wrap the "
                          f"model: model = DistributedDataParallel(model)")

    def matches():
        data_parallel()
        want = _trajectory(world, **kw)[0]
        d, name = _max_diff(values[0], want)
        if d <= 1e-5:
            return f"max |diff| from one process on the global batch: {d:.1e}"
        for mistake, why in _MISTAKES:
            if _max_diff(values[0], _trajectory(world, **mistake(kw, world))[0])[0] <= 1e-5:
                raise AssertionError(f"the parameters are off (max |diff| {d:.2e} in {name}): {why}")
        raise AssertionError(
            f"the parameters differ from one process training on the global batch (max |diff| "
            f"{d:.2e} in {name}). Check: lk.train.make_model(dropout=0.0) and make_dataset(); "
            f"DistributedSampler(data, shuffle=True, seed=0) with set_epoch(epoch); per-rank "
            f"batch batch_size // world_size; SGD(lr, momentum=0.9); mean cross-entropy loss")

    def synced():
        runs()
        problem = sync_problem()
        assert problem is None, problem
        return "every rank trained on its own DistributedSampler shard and its DDP all-reduced " \
               "its shard's gradients every step (gloo's flight recorder, a comm hook)"

    def destroyed():
        data_parallel()
        left = [r["rank"] for r in reports if r.get("pg_left")]
        assert not left, (f"rank(s) {left} returned with the process group still initialised: "
                          f"call dist.destroy_process_group() in a finally: block")

    def quiet():
        data_parallel()
        noisy = [r for r in reports if r["rank"] != 0 and r.get("stdout", "").strip()]
        assert not noisy, (f"rank {noisy[0]['rank']} printed "
                           f"{noisy[0]['stdout'].strip().splitlines()[0]!r}: log only on rank 0 "
                           f"(if rank == 0: print(...))")

    return [case("runs under torchrun on 2 ranks", runs),
            case("every rank ends with the same parameters", same),
            case("equals one process on the global batch", matches),
            case("shards the data and all-reduces the gradients", synced),
            case("destroys the process group", destroyed),
            case("only rank 0 prints", quiet)]


# ---------------------------------------------------------------- the reference run
def _train_in_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    return train(parse_args(argv))


def reference(argv: list[str], world_size: int = 2) -> dict:
    """Final parameters of an uninterrupted run on ``world_size`` warm lab ranks (``lk.run``).

    The comparison point for a restarted torchrun run: same options, same world
    size, no fault, no snapshots. Example::

        ref = lk.torchrun.reference(["--epochs", "2"], world_size=2)
    """
    argv = list(argv) + ["--snapshot-dir", "", "--log-every", "1000000"]
    return run(_train_in_rank, world_size, args=(argv,), echo=False).values[0]


# ---------------------------------------------------------------- quiz key (notebook 05)
def last_resume_step(run: Run) -> int:
    """Quiz key (05.resume_step): the step the last restarted attempt of ``run`` resumed from."""
    if not isinstance(run, Run) or not resumes(run):
        raise ValueError("`run` has no resumed attempt: run the crash-and-kill cells first")
    return resumes(run)[-1]


