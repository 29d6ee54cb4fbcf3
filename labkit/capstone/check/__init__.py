"""The capstone grader (notebook 08): the learner's pieces, run in the real script under torchrun.

The learner writes ``all_reduce_sums`` (the evaluation's all-reduce, on the core
path: §5) and, in a deep dive (§10), ``save_checkpoint`` and ``load_checkpoint``
(DCP) with ``capstone_pieces()`` returning those two by name. Each rubric item of
``quizzes/08_capstone.toml`` is one checker here with one named case:
:func:`check_evaluates` grades ``all_reduce_sums`` alone (item (c): the script
under torchrun with the learner's reduction and its own checkpoint code); the
other three grade ``capstone_pieces`` and come from the same runs, made once per
set of pieces (:mod:`.runs`) and reused:

(a) ``08.trains``: ``train_gpt.py --pieces`` under ``torchrun
    --nproc-per-node=2`` (FSDP2) logs every step with exactly the loss of the
    checker's own run, and writes a whole checkpoint;
(b) ``08.resumes``: rank 1 is SIGKILLed after step 4; torchrun restarts, the
    run resumes from step 3 with the learner's load, every later loss and the
    final parameters are bit-identical to the checker's uninterrupted run;
(c) ``08.evaluates``: the script's window losses equal one process evaluating the
    same parameters, and on every rank the learner's reduction returns exactly the
    sums of what the ranks were given (each loss disguised by a per-grading
    secret: evaluating again on every rank does not give it), through at least
    one collective (not the store or a file); a wrong result is told which known
    mistake it matches, or only what is wrong with it;
(d) ``08.reshards``: the learner's 2-rank checkpoint, every floating-point
    tensor in it doubled by the checker (so that only a load that reads the
    folder gets it right), loaded by the learner's load on 1 rank
    (``--nproc-per-node=1``), holds bit for bit the model and optimizer state of
    the checker's run at that step, doubled, and training goes on.

Nothing the learner's code reports is trusted: the numbers come from the
project's own script and from probes around the learner's functions
(:mod:`.probes`), and are compared with the checker's own runs. Pieces that call
the project's own implementations (however they reach them) fail the item they
serve. State kept in memory cannot pass: every attempt and the 1-rank run are
new processes. What is not seen: the payload of the collectives an evaluation
runs (a dummy collective beside a store would pass (c)'s last test). A case the
checker cannot verify fails and says why. Also here: the quiz keys.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Callable

from ...portable.checkpoints import problems
from ...grading.exercise import Case, case
from ...runtime.torchrun.log import Run
from ...torchrun.runs import losses, resumes
from . import runs as R
from .probes import read_evals, read_guarded, read_loads

__all__ = ["ITEMS", "NEEDS", "grade", "grade_evaluation", "check_trains", "check_resumes",
           "check_evaluates", "check_reshards", "pieces_of", "last_resume_step",
           "steps_done_twice", "throughput_ratio", "scaling_efficiency"]

ITEMS = {"a": "(a) trains under torchrun on 2 ranks",
         "b": "(b) resumes bit-identically after a SIGKILL",
         "c": "(c) distributed eval equals single-process eval",
         "d": "(d) the checkpoint reshards 2 -> 1"}
NAMES = ("all_reduce_sums", "save_checkpoint", "load_checkpoint")
CHECKPOINT = ("save_checkpoint", "load_checkpoint")
# the pieces each rubric item judges: (c) the reduction alone, the others the checkpoint code
NEEDS = {"a": CHECKPOINT, "b": CHECKPOINT, "c": ("all_reduce_sums",), "d": CHECKPOINT}


def _needed(items: str) -> tuple[str, ...]:
    return tuple(n for n in NAMES if any(n in NEEDS[i] for i in items))


def pieces_of(fn, names: tuple[str, ...] = CHECKPOINT) -> dict[str, Callable]:
    """The learner's functions from ``capstone_pieces()``, exactly ``names`` (AssertionError:
    why not). The notebook's ``capstone_pieces`` returns the two checkpoint functions."""
    assert callable(fn), f"capstone_pieces must be a function, got {type(fn).__name__}"
    pieces = fn()
    assert isinstance(pieces, dict) and set(pieces) == set(names), (
        f"capstone_pieces() must return a dict with exactly the keys {list(names)}, got "
        f"{sorted(pieces) if isinstance(pieces, dict) else type(pieces).__name__}")
    for name, f in pieces.items():
        _own(f, f"capstone_pieces()[{name!r}]", name)
    return dict(pieces)


def _own(f, what: str, name: str) -> None:
    """AssertionError unless ``f`` is a function and not the project's own ``name``."""
    assert callable(f), f"{what} is {type(f).__name__}, not a function"
    module = getattr(f, "__module__", "") or ""
    assert not module.startswith("labkit."), (
        f"{what} is {module}.{getattr(f, '__qualname__', name)}, the project's own: write your "
        f"own {name}")


def _is_stub(f) -> bool:
    code = getattr(f, "__code__", None)
    return code is not None and set(code.co_names) == {"NotImplementedError"}


_CACHE: dict[str, dict[str, Case]] = {}


def _digest(pieces: dict) -> str:
    try:
        return R.digest(pieces)
    except Exception:  # noqa: BLE001  (an unpicklable answer is graded, and fails, below)
        return repr(sorted((k, id(v)) for k, v in pieces.items()))


def grade(fn, items: str = "abd") -> dict[str, Case]:
    """Run the capstone grader on ``fn``, a ``capstone_pieces``: ``{item letter: Case}``.

    ``fn()`` returns exactly the pieces the ``items`` judge (:data:`NEEDS`): the notebook's
    ``capstone_pieces`` the two checkpoint functions for (a), (b) and (d); the tests grade a
    reduction and a checkpoint code together in one run ("abcd"). Without ``b`` nobody is
    killed; without ``d`` there is no 1-rank run; without ``c`` the script evaluates with its
    own reduction.
    """
    try:
        pieces = pieces_of(fn, _needed(items))
    except AssertionError as exc:
        return {i: Case(ITEMS[i], False, str(exc)) for i in items}
    return _grade_pieces(pieces, items)


def grade_evaluation(all_reduce_sums) -> Case:
    """Item (c) alone, on the learner's ``all_reduce_sums`` (notebook 08 §5, the core path):
    the script under torchrun on 2 ranks with that reduction and its own checkpoint code."""
    try:
        _own(all_reduce_sums, "all_reduce_sums", "all_reduce_sums")
    except AssertionError as exc:
        return Case(ITEMS["c"], False, str(exc))
    return _grade_pieces({"all_reduce_sums": all_reduce_sums}, "c")["c"]


def _grade_pieces(pieces: dict, items: str) -> dict[str, Case]:
    if all(_is_stub(f) for f in pieces.values()):
        raise NotImplementedError(f"{', '.join(pieces)}: still "
                                  f"{'a stub' if len(pieces) == 1 else 'stubs'}")
    key = _digest(pieces)
    hit = _CACHE.get(key, {})
    if set(items) <= set(hit):
        return {i: hit[i] for i in items}
    with tempfile.TemporaryDirectory(prefix="labkit-capstone-check-") as tmp:
        cases = _run_cases(pieces, Path(tmp), items)
    if len(_CACHE) > 8:           # one set of pieces at a time in a notebook; a few in tests
        _CACHE.clear()
    _CACHE[key] = cases
    return cases


def _run_cases(pieces: dict, work: Path, items: str) -> dict[str, Case]:
    import sys

    from tqdm.auto import tqdm

    # a bar that stays: the grading takes a minute, the notebook shows where it is
    bar = tqdm(total=2 + ("d" in items), desc="capstone grader (reference, 2 ranks, 1 rank)",
               unit="run", disable="ipykernel" not in sys.modules)
    started = []

    def start_one_rank() -> None:
        if not problems(_ckpt(work / "two", R.FIRST_CKPT)):
            started.append(R.start_reshard(pieces, work / "one", _ckpt(work / "two", R.FIRST_CKPT)))

    try:
        ref = R.reference(work)
        bar.update()
        first = R.learner_run(pieces, work / "two", kill="b" in items,
                              on_kill=start_one_rank if "d" in items else None)
        bar.update()
        if "d" in items and not started:
            start_one_rank()
        one = R.finish(started[0]) if started else None
        bar.update("d" in items)
        cases = {}
        if "a" in items:
            cases["a"] = case(ITEMS["a"], lambda: _trains(first, ref))
        if "b" in items:
            cases["b"] = case(ITEMS["b"], lambda: _resumes(first, ref))
        if "c" in items:
            cases["c"] = case(ITEMS["c"], lambda: _evaluates(first, ref))
        if "d" in items:
            cases["d"] = case(ITEMS["d"], lambda: _reshards(first, one, ref))
    finally:
        for job, _ in started:
            if job._result is None:
                job.stop()
        bar.close()
    return {i: cases[i] for i in items}


def _one(item: str) -> Callable:
    def checker(fn) -> list[Case]:
        return [grade(fn)[item]]
    checker.__name__ = f"check_{item}"
    checker.__doc__ = (f"Bank checker of rubric item {ITEMS[item]} on ``capstone_pieces`` (the "
                       f"three checkpoint items share one grading run).")
    return checker


check_trains, check_resumes, check_reshards = (_one(i) for i in "abd")


def check_evaluates(all_reduce_sums) -> list[Case]:
    """Bank checker of rubric item (c) on the learner's ``all_reduce_sums`` (its own run)."""
    return [grade_evaluation(all_reduce_sums)]


# ------------------------------------------------------------------ (a) trains
def _ckpt(run: R.LearnerRun | Path, step: int) -> Path:
    out = run.out if isinstance(run, R.LearnerRun) else run / "run"
    return out / "checkpoints" / f"step_{step:08d}"


def _why(run: R.LearnerRun, after: float = -1.0) -> str:
    if run.stuck:
        return f"the checker stopped it: {run.stuck}"
    err = R.first_error(run.run, after)
    return err or (run.run.tail(6) if run.run else "torchrun did not start")


def _trains(first: R.LearnerRun, ref: R.Reference) -> str:
    run = first.run
    assert run is not None, f"torchrun did not start: {_why(first)}"
    assert any("local_ranks=[0, 1]" in ln.text for ln in run.agent_lines()), (
        f"torchrun never started its 2 workers: {_why(first)}")
    logged = [(s, loss) for s, loss, a in losses(run) if a == 0]
    for step, loss in logged:
        assert loss == ref.losses[step], (
            f"step {step}: rank 0 logged loss {loss:.6f}, the checker's own run {ref.losses[step]:.6f}:"
            f" your pieces changed the training (a save_checkpoint that changes the model or "
            f"draws random numbers?)")
    need = R.KILL_AFTER if first.killed else R.STEPS
    reached = max((s for s, _ in logged), default=0)
    assert reached >= need, (f"the first attempt stopped after step {reached} of {need}: "
                             f"{_why(first)}")
    folder = _ckpt(first, R.FIRST_CKPT)
    bad = problems(folder)
    assert not bad, f"no whole checkpoint at step {R.FIRST_CKPT}: {'; '.join(bad)}"
    if not first.killed:
        assert run.ok, f"the run failed: {_why(first)}"
    files = len(list(folder.iterdir())) - 1
    return (f"2 workers (FSDP2), steps 1-{reached} with the checker's own losses, checkpoint at "
            f"step {R.FIRST_CKPT} whole ({files} files)")


# ------------------------------------------------------------------ (b) resumes
def _difference(a, b, where: str = "") -> str:
    """Where ``a`` (what the learner's load left) first differs from ``b`` (the saved state)."""
    import torch

    if isinstance(b, dict):
        if not isinstance(a, dict):
            return f"{where or 'it'} is {type(a).__name__}"
        missing = [k for k in b if k not in a]
        if missing:
            return f"{where}[{missing[0]!r}] is missing" + (f" ({len(missing)} entries)"
                                                           if len(missing) > 1 else "")
        return next((d for k in b if (d := _difference(a[k], b[k], f"{where}[{k!r}]"))), "")
    if isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or len(a) != len(b):
            return f"{where} has another length"
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     if (d := _difference(x, y, f"{where}[{i}]"))), "")
    if isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and torch.equal(a, b)
        return "" if ok else f"{where} differs"
    return "" if a == b else f"{where} is {a!r}, saved {b!r}"


def _after_load(loads: list[dict], saved: dict | None, rng: bool) -> str:
    """What the learner's load left wrong, compared with the state at the save ("" if nothing)."""
    if saved is None:
        return "the checker has no state for that step (a bug of the checker)"
    if not loads:
        return "load_checkpoint raised or never returned on some rank"
    zero = next((r for r in loads if r["rank"] == 0), None)
    wrong = []
    if all(r.get("unchanged") for r in loads):
        wrong.append("the model is exactly as the script built it before the load: nothing was "
                     "restored from the checkpoint (state kept in memory is gone: every attempt "
                     "and the 1-rank run are new processes; read the checkpoint folder)")
    if zero is not None:
        if d := _difference(zero["model"], saved["model"], "model"):
            wrong.append(f"the model's parameters are not the saved ones ({d})")
        if d := _difference(zero["optim"], saved["optim"], "optimizer"):
            wrong.append(f"the optimizer's state is not the saved one ({d}): save and load "
                         f"Adam's moments and step counts too")
    if rng:
        import torch

        for r in sorted(loads, key=lambda r: r["rank"]):
            if not torch.equal(r["rng"], saved["rng"][r["rank"]]):
                wrong.append(f"rank {r['rank']}'s RNG state is not the one at the save (its "
                             f"dropout masks will differ): save each rank's "
                             f"torch.get_rng_state() (and, on a GPU, torch.cuda.get_rng_state(device)) "
                             f"and restore it when restore_rng is True")
                break
    return "; ".join(wrong)


def _resumes(first: R.LearnerRun, ref: R.Reference) -> str:
    assert first.killed, (f"could not be verified: the run never got past step {R.KILL_AFTER}, "
                          f"where rank 1 is SIGKILLed (see (a)): {_why(first)}")
    _not_the_projects(first, "save_checkpoint and load_checkpoint",
                      "labkit.capstone.sharded_checkpoint.")
    run = first.run
    starts = resumes(run)
    restart = next((ln.t for ln in run.agent_lines() if "restart_count=1" in ln.text),
                   first.killed_at + 2.0)
    why = _why(first, restart)      # not the peers' errors that the kill itself caused
    assert starts, f"after the SIGKILL the restarted workers did not resume: {why}"
    start = starts[-1]
    loads = [r for r in read_loads(first.probes) if r["attempt"] == 1]
    wrong = _after_load(loads, ref.saved.get(start), rng=True)
    hint = f" After your load_checkpoint, {wrong}." if wrong else ""
    assert not first.stuck, f"{why}.{hint}"
    later = [(s, loss) for s, loss, a in losses(run) if a == 1]
    for step, loss in later:
        assert loss == ref.losses[step], (
            f"resumed from step {start}, step {step} logged loss {loss:.6f}; uninterrupted: "
            f"{ref.losses[step]:.6f}.{hint or ' The state after the load is the saved one, so '}"
            f"{'' if hint else 'something else changed.'}")
    assert run.ok, f"the restarted attempt failed: {why}.{hint}"
    assert later and later[-1][0] == R.STEPS, f"the run did not reach step {R.STEPS}"
    import torch

    final = torch.load(first.out / "final.pt", weights_only=True)
    assert not (d := _difference(final, ref.final, "final")), (
        f"the final parameters are not bit-identical to the uninterrupted run ({d}).{hint}")
    assert not wrong, f"every loss matched, but after your load_checkpoint, {wrong}"
    return (f"SIGKILL after step {R.KILL_AFTER}, resumed from step {start}: steps "
            f"{start + 1}-{R.STEPS} and all {len(final)} parameter tensors bit-identical to the "
            f"checker's uninterrupted run")


def _not_the_projects(run: R.LearnerRun, piece: str, prefix: str) -> None:
    """Fail when the learner's pieces called the project's own ``prefix...`` functions."""
    used = sorted(u for u in read_guarded(run.probes) if u.startswith(prefix))
    assert not used, (f"your pieces called {', '.join(used)}: the project's own implementation "
                      f"(the checker's oracle) did the work of {piece}. Write your own")


# ------------------------------------------------------------------ (c) evaluates
def _oracle(model_state: dict) -> tuple[list[float], float, int]:
    """One process, the same parameters: each window's loss, the mean, the number of windows."""
    import torch

    from .. import train_gpt as G
    from ..evaluate import all_reduce_sums, evaluate
    from ..model import GPTConfig, make_gpt

    cfg = G.parse_args(R.ARGV)
    model = make_gpt(GPTConfig(cfg.block_size, 256, cfg.n_layer, cfg.n_head, cfg.n_embd,
                               cfg.dropout))
    model.load_state_dict(model_state)
    _, val, _ = G._data(cfg)
    seen = []

    def capture(window_losses, real, device):
        seen.extend(window_losses.tolist())
        return all_reduce_sums(window_losses, real, device)
    result = evaluate(model, val, cfg.eval_batch, torch.device("cpu"), reduce=capture)
    return seen, result.loss, result.windows


def _sums(records: list[dict], key: str, real_only: bool = True) -> list[tuple[float, int]]:
    """Each rank's (sum, count) of ``key``'s losses: the real windows, or all with padding."""
    return [(math.fsum(x for x, k in zip(r[key], r["real"]) if k or not real_only),
             sum(r["real"]) if real_only else len(r["real"])) for r in records]


def _mistakes(records: list[dict]) -> list[tuple[Callable, str]]:
    """Known wrong reductions: (does rank i's result (sum, count) match it?, what it is).

    Everything is computed from what each rank was given ("given") and what the script
    computed ("losses"), so that only what an answer really did matches.
    """
    world = len(records)
    own, padded = _sums(records, "given"), _sums(records, "given", real_only=False)
    total, total_padded = [tuple(map(sum, zip(*x))) for x in (own, padded)]
    undisguised = tuple(map(sum, zip(*_sums(records, "losses"))))
    pad = total_padded[1] - total[1]

    def every(pair):
        return lambda i, s, c: _near(s, pair[0]) and c == int(pair[1])

    def each(pairs):
        return lambda i, s, c: _near(s, pairs[i][0]) and c == int(pairs[i][1])

    means = [s / c for s, c in own]
    out = [
        (every(undisguised), "That is the sum over every window of the losses the script "
         "computed, not of the losses each rank's all_reduce_sums was given (the checker gives "
         "every rank its own numbers): the evaluation was done again, not split over the ranks. "
         "Add only this rank's given window_losses, then dist.all_reduce the sums"),
        (each(own), "Each rank returned its own windows only: add the sums over the ranks "
         "(dist.all_reduce)"),
        (every(total_padded), f"{total_padded[1]} windows were counted, {pad} of them "
         f"DistributedSampler's padding duplicates: count only the windows where real is True"),
        (every((total_padded[0], total[1])), "The count is right, but the sum adds the losses "
         "of DistributedSampler's padding duplicates too: add only window_losses[real]"),
        (every((total[0], total_padded[1])), f"The sum is right, but the count includes the "
         f"{pad} padding duplicate(s): count only the windows where real is True"),
        (each([(world * s, world * c) for s, c in own]), f"Each rank returned {world} x its own "
         f"sums: multiplying by the world size is not adding the other ranks' windows "
         f"(dist.all_reduce with ReduceOp.SUM)"),
        (every((total[0] / world, total[1] / world)), "The sums were averaged over the ranks "
         "(ReduceOp.AVG, or divided by the world size): add them (ReduceOp.SUM)"),
        (every((total[0] / total[1], total[1])), "The first number is the mean, not the sum: "
         "return the sum (the script divides by the count)"),
        (lambda i, s, c: c > 0 and _near(s / c, sum(means) / world), "That is the average of "
         "each rank's mean: ranks with fewer real windows weigh too much. Add sums and counts, "
         "then divide once"),
        (lambda i, s, c: c == total[1] and s != total[0]
         and abs(s / c - total[0] / total[1]) <= 1e-6 * abs(total[0] / total[1]),
         "Close, not equal: add in float64 (a float32 sum rounds); one process and N ranks then "
         "give the same bits"),
    ]
    for j, (s, c) in enumerate(own):
        out.append((every((world * s, world * c)), f"Every rank got {world} x rank {j}'s own "
                    f"sums: rank {j}'s numbers were counted {world} times and the other ranks' "
                    f"never (a broadcast from rank {j} times the world size?). Add each rank's "
                    f"own sums (dist.all_reduce with ReduceOp.SUM)"))
    return out


def _near(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _judge(records: list[dict], oracle: list[float], n: int, when: str) -> str:
    """Compare every rank's recorded result with the exact sum of what the ranks were given
    ("" or what is wrong): name the known mistake it matches, or only what is wrong."""
    from ..evaluate import rank_windows

    world = records[0]["world"]
    for rec in records:
        idx, _ = rank_windows(n, rec["rank"], world)
        assert rec["losses"] == [oracle[i] for i in idx], (
            f"could not be verified: at {when} the script gave rank {rec['rank']} other window "
            f"losses than one process computes for the same parameters (training differed: "
            f"see (a))")
    for rec in records:
        if not isinstance(rec["out"], list):
            return (f"at {when}, rank {rec['rank']}'s all_reduce_sums returned {rec['out']}, "
                    f"not (sum, count)")
    right = tuple(map(sum, zip(*_sums(records, "given"))))      # exact: float64 of float32s
    wrong = [r for r in records if not (r["out"][1] == n and r["out"][0] == right[0])]
    if not wrong:
        assert all(r["collectives"] is not None for r in records), (
            f"could not be verified: at {when} the right sums came back, but this torch does "
            f"not number the collectives of its process groups, so the checker cannot tell an "
            f"all-reduce from a side channel")
        silent = [r["rank"] for r in records if r["collectives"] < 1]
        return "" if not silent else (
            f"at {when} every rank returned the right sums, but rank {silent[0]}'s "
            f"all_reduce_sums ran no collective on any process group: the numbers reached it "
            f"another way (the process group's store, a file, a socket: a side channel). Add "
            f"them with dist.all_reduce")
    bad = wrong[0]
    got = bad["out"]
    head = (f"at {when}, rank {bad['rank']}'s all_reduce_sums returned ({got[0]!r}, {got[1]}); "
            f"the real windows' losses the ranks were given add up to ({right[0]!r}, {n})")
    matched = [what for test, what in _mistakes(records)
               if all(test(i, *r["out"]) for i, r in enumerate(records))]
    if len(matched) == 1:
        return f"{head}. {matched[0]}"
    if len({tuple(r["out"]) for r in records}) > 1:
        each = "; ".join(f"rank {r['rank']}: ({r['out'][0]!r}, {r['out'][1]})" for r in records)
        what = f"{head}. The ranks disagree ({each}): every rank must get the same sums"
    else:
        part = ("count" if got[0] == right[0] else "sum" if got[1] == n else "sum and count")
        what = f"{head}: the {part} {'are' if part == 'sum and count' else 'is'} wrong"
    if matched:
        named = " / ".join(m.split(":")[0].split(". ")[0] for m in matched)
        what += (f" (it matches more than one known mistake on these windows, so none is "
                 f"named: {named})")
    return (f"{what}. Return (sum of the real windows' losses, their number), each added over "
            f"all ranks")


def _evaluates(first: R.LearnerRun, ref: R.Reference) -> str:
    evals = read_evals(first.probes)
    at3 = [e for e in evals if e["attempt"] == 0 and e["index"] == 0]
    assert len(at3) == 2, (f"could not be verified: no evaluation at step {R.EVAL_EVERY} on "
                           f"both ranks ({len(at3)} recorded): {_why(first)}")
    _not_the_projects(first, "all_reduce_sums", "labkit.capstone.evaluate.")
    oracle, want, n = _oracle(ref.saved[R.EVAL_EVERY]["model"])
    wrong = _judge(at3, oracle, n, f"step {R.EVAL_EVERY}")
    assert not wrong, wrong
    detail = f"step {R.EVAL_EVERY}: val loss {want:.6f} over {n} windows on both ranks, == one process"
    run = first.run
    if run is not None and run.ok and (first.out / "final.pt").exists():
        import torch

        last = max(e["attempt"] for e in evals)
        ends = [max((e for e in evals if e["attempt"] == last and e["rank"] == r),
                    key=lambda e: e["index"]) for r in (0, 1)]
        oracle, want, n = _oracle(torch.load(first.out / "final.pt", weights_only=True))
        wrong = _judge(ends, oracle, n, f"step {R.STEPS} (the end)")
        assert not wrong, wrong
        detail += f"; step {R.STEPS}: {want:.6f}, =="
    return detail


# ------------------------------------------------------------------ (d) reshards
def _reshards(first: R.LearnerRun, one: R.LearnerRun | None, ref: R.Reference) -> str:
    bad = problems(_ckpt(first, R.FIRST_CKPT))
    assert one is not None and not bad, (
        f"could not be verified: no whole checkpoint written by 2 ranks at step "
        f"{R.FIRST_CKPT} to reshard (see (a)): {'; '.join(bad) or _why(first)}")
    loads = read_loads(one.probes)
    text = "\n".join(one.run.rank_lines()) if one.run else ""
    assert loads, f"load_checkpoint on 1 rank failed: {_why(one)}"
    assert "resharded 2 -> 1" in text, "the 1-rank run did not resume from the 2-rank checkpoint"
    for run in (first, one):
        _not_the_projects(run, "save_checkpoint and load_checkpoint",
                          "labkit.capstone.sharded_checkpoint.")
    assert one.notes[0].startswith("doubled"), (
        f"could not be verified: {one.notes[0]}. The checker changes what the checkpoint holds "
        f"(every floating-point tensor x 2) to see that your load restores the folder's "
        f"contents: save with torch.distributed.checkpoint (dcp.save)")
    saved = ref.saved[R.FIRST_CKPT]
    wrong = _after_load(loads, R.doubled(saved), rng=False)
    assert not wrong or _after_load(loads, saved, rng=False), (
        f"saved by 2 FSDP ranks, loaded on 1: your load_checkpoint restored the state at the "
        f"save, but not what the checkpoint folder holds. The checker doubled every "
        f"floating-point tensor in the folder's copy ({one.notes[0][len('doubled: '):]}) and "
        f"the load did not follow: the state came from somewhere else (a file outside the "
        f"checkpoint folder, a copy kept elsewhere: a side channel). A checkpoint must hold "
        f"everything in its folder: the script keeps, deletes and copies folders")
    assert not wrong, (f"saved by 2 FSDP ranks, loaded on 1: {wrong}. (A file per rank that "
                       f"holds its own shard loads only on the same world size: save with "
                       f"torch.distributed.checkpoint, dcp.save of get_state_dict(model, "
                       f"optimizer), and load with dcp.load into the state dict of the model and "
                       f"optimizer as they are now, then set_state_dict)")
    assert one.run.ok and f"done: {R.STEPS} steps on 1 rank(s)" in text, (
        f"it loaded exactly, then failed: {_why(one)}")
    return (f"saved by 2 FSDP ranks at step {R.FIRST_CKPT}, loaded on 1: every parameter and "
            f"Adam's state bit for bit what the folder holds (the checker's, each tensor "
            f"doubled in the copy); trained on to step {R.STEPS}")


# ------------------------------------------------------------------ quiz keys (notebook 08)
def _run_of(run) -> Run:
    if not isinstance(run, Run):
        raise ValueError("`run` is not a torchrun Run: run the launch-and-kill cells first")
    return run


def last_resume_step(run) -> int:
    """Quiz key (08.resume_step): the step the restarted attempt of ``run`` resumed from."""
    starts = resumes(_run_of(run))
    if not starts:
        raise ValueError("`run` has no resumed attempt: run the launch-and-kill cells first")
    return starts[-1]


def steps_done_twice(run) -> int:
    """Quiz key (08.steps_twice): how many steps ``run`` logged in more than one attempt."""
    attempts: dict[int, set] = {}
    for step, _, attempt in losses(_run_of(run)):
        attempts.setdefault(step, set()).add(attempt)
    return sum(len(a) > 1 for a in attempts.values())


def throughput_ratio(run, resharded) -> float:
    """Quiz key (08.speedup): median tokens/s of ``run`` (2 ranks) / of ``resharded`` (1 rank)."""
    from ..runs import throughput

    return throughput(_run_of(run)).median / throughput(_run_of(resharded)).median


def scaling_efficiency(run, resharded) -> float:
    """Quiz key (08.speedup): notebook 07's scaling efficiency of 2 ranks, the median tokens/s
    of ``run`` (2 ranks) / of ``resharded`` (1 rank), divided by 2."""
    return throughput_ratio(run, resharded) / 2
