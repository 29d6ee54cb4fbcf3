"""Checking the dispatch and combine of expert parallelism: notebook 09's ``09.moe_dispatch``.

The learner writes ``dispatch_combine(tokens, expert_of_token, experts_per_rank, expert_fn)``,
called in every rank with this rank's tokens ``[T, d]``, the expert each token is routed to
(global ids; expert e lives on rank ``e // experts_per_rank``) and ``expert_fn(j, rows)``, which
runs this rank's local expert j (0 … experts_per_rank − 1) on a batch of rows. It returns
``[T, d]``: row t is token t's expert's output, in token order. The two exchanges
(``dist.all_to_all_single`` of the counts, then of the tokens sorted by destination, and back)
are the exercise; the routing is given.

Every world size (2, 3, 4 ranks) is one fresh gloo job that runs every scenario of
:data:`SCENARIOS` in turn (uneven routing and token counts; a rank that sends nothing to
another; a rank whose experts receive nothing; a case large enough to count bytes). A case
passes only if, on every rank:

* **the output equals the oracle** bit for bit: the checker rebuilds every rank's tokens,
  routing and expert weights from the secret each rank drew (``os.urandom``) and reported
  *after* the answer ran, and computes each token's expert output in one process. Integer
  tokens and weights make every sum exact, whatever order an answer adds in. A wrong output
  is diagnosed: rows left in expert order (the unsort forgotten), the right rows in another
  order, each rank's own experts run on its own tokens (no token travelled), the tokens
  handed back unchanged;
* **the expert weights exist only on their owner**: each rank's ``expert_fn`` holds that rank's
  experts only, drawn from its own secret, and refuses an index that is not local. Each local
  expert may run on no more rows than were routed to it (an answer that runs experts on
  tokens not routed to them — every token everywhere — fails, named);
* **what the rank sent** (:class:`labkit.grading.watch.Watch`): no collective but all-to-all
  (gloo's flight recorder lists any, whatever route or thread issued it: an ``all_gather`` of
  the tokens fails, named); at least the bytes of the rows that had to leave the rank (the
  tokens it routed away, the outputs of the tokens it received): fewer, and the data went by
  a side channel (the store, a file); in the bytes case, at most those rows plus room for the
  counts, an expert id per row and gloo's framing: more, and the rank sent tokens nobody
  needed (every token to every rank);
* **not the lab's own**: ``lk``'s ``dispatch_combine`` and ``exchange_counts``
  (:mod:`labkit.grading.references`) fail the case, named.

A stub raising ``NotImplementedError`` is "not done yet".
"""
from __future__ import annotations

import json
import os
import zlib
from collections import Counter
from typing import Callable

from ...collectives.check.runs import clean, failure, recorder_env, stuck
from ...grading.exercise import Case, NotDone
from ...grading.references import reference_problem, references_used
from ...grading.watch import Watch
from ...runtime import run
from ...runtime.result import error_kind

__all__ = ["SCENARIOS", "BYTES", "HIDDEN", "scenario", "expert_rows", "dispatch_job",
           "check_moe_dispatch"]

BYTES = "bytes sent"
HIDDEN = 4                         # each expert's hidden width
HEADER = 144                       # gloo's framing per message (09's claim tests)
# name -> experts per rank, token width, tokens on rank r of n, which experts a rank may pick
SCENARIOS: dict[str, dict] = {
    "uneven routing": dict(epr=2, d=8, tokens=lambda r, n: 3 + 4 * r, route="skewed"),
    "a rank sends nothing to another": dict(epr=1, d=8, tokens=lambda r, n: 7 + r,
                                            route="avoid"),
    BYTES: dict(epr=2, d=64, tokens=lambda r, n: 96, route="uniform"),
    "a rank receives nothing": dict(epr=2, d=8, tokens=lambda r, n: 9 - r, route="starve"),
}
_LAB = ("labkit.sequences_experts.experts.",)
_OK_COLLECTIVES = ("gloo:all_to_all",)


def _allowed(route: str, rank: int, n: int, epr: int) -> list[int]:
    """The experts rank ``rank`` may route to in a scenario."""
    everything = list(range(n * epr))
    if route == "avoid" and rank == 0:              # rank 0 sends nothing to rank 1
        return [e for e in everything if e // epr != 1]
    if route == "starve":                           # nobody sends to rank n - 1
        return [e for e in everything if e // epr != n - 1]
    return everything


def scenario(name: str, rank: int, n: int, secret: int) -> dict:
    """Rank ``rank``'s inputs in scenario ``name``, from its ``secret``: ``tokens`` [T, d]
    (whole numbers -3..3), ``experts`` [T] (global ids, never already in sorted order when two
    or more are allowed), ``weights``: per local expert (W1 [d, h], W2 [h, d]), whole numbers
    -2..2."""
    import torch
    sc = SCENARIOS[name]
    epr, d, T = sc["epr"], sc["d"], sc["tokens"](rank, n)
    g = torch.Generator().manual_seed(zlib.crc32(f"moe/{name}/{rank}/{n}".encode()) ^ secret)
    tokens = torch.randint(-3, 4, (T, d), generator=g).float()
    allowed = torch.tensor(_allowed(sc["route"], rank, n, epr))
    weight = (torch.arange(len(allowed)) + 1.0) ** 2 if sc["route"] == "skewed" \
        else torch.ones(len(allowed))
    pick = torch.multinomial(weight, T, replacement=True, generator=g)
    experts = allowed[pick]
    if len(allowed) > 1 and T > 1:                  # unsorted for sure: unsorting matters
        experts[0], experts[-1] = allowed[-1], allowed[0]
    weights = [(torch.randint(-2, 3, (d, HIDDEN), generator=g).float(),
                torch.randint(-2, 3, (HIDDEN, d), generator=g).float()) for _ in range(epr)]
    return {"tokens": tokens, "experts": experts, "weights": weights, "epr": epr, "d": d}


def expert_rows(weights, rows):
    """One expert on ``rows``: ReLU(rows · W1) · W2 (exact: whole numbers)."""
    w1, w2 = weights
    return (rows @ w1).relu() @ w2


def _expert_fn(rank: int, data: dict, ran: list[int]) -> Callable:
    """This rank's experts and nobody else's: ``expert_fn(j, rows)``."""
    import torch
    epr, d, weights = data["epr"], data["d"], data["weights"]
    first = rank * epr

    def expert_fn(j, rows):
        if isinstance(j, torch.Tensor):
            j = int(j)
        if not isinstance(j, int) or not 0 <= j < epr:
            raise ValueError(f"expert_fn({j!r}, ...): rank {rank} holds experts {first}.."
                             f"{first + epr - 1} only, as local indices 0..{epr - 1}; the "
                             f"weights of every other expert live on its own rank (expert e "
                             f"on rank e // experts_per_rank): send the token there")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != d:
            raise ValueError(f"expert_fn(j, rows) takes rows of shape [m, {d}], got "
                             f"{getattr(rows, 'shape', type(rows).__name__)}")
        ran[j] += int(rows.shape[0])
        return expert_rows(weights[j], rows.float())

    return expert_fn


def dispatch_job(rank: int, world_size: int, fn: Callable, names: list[str]) -> list[dict]:
    """In every rank: each scenario in turn, the answer watched. One row per scenario, also
    printed as an ``@labkit-row`` line (the rows done survive a later scenario that hangs):
    ``{case, secret, out (list or a description), sent, collectives, unwatched, references,
    ran (rows per local expert)}``; ``{case, status: "not done"}`` for a stub."""
    import torch
    watcher = Watch()                       # all ranks together: it runs one all_reduce
    rows = []
    for name in names:
        print(f"@labkit-case {name}", flush=True)
        secret = int.from_bytes(os.urandom(8), "little")
        data = scenario(name, rank, world_size, secret)
        ran = [0] * data["epr"]
        expert_fn = _expert_fn(rank, data, ran)
        watcher.start()
        try:
            with references_used(*_LAB) as lab:
                out = fn(data["tokens"].clone(), data["experts"].clone(), data["epr"],
                         expert_fn)
        except NotImplementedError:
            rows.append({"case": name, "status": "not done"})
            print("@labkit-row " + json.dumps(rows[-1]), flush=True)
            break
        except Exception as exc:
            raise RuntimeError(f"scenario {name!r}: {type(exc).__name__}: {exc}") from exc
        seen = watcher.stop()
        if isinstance(out, torch.Tensor):
            shown = {"shape": list(out.shape), "dtype": str(out.dtype).replace("torch.", ""),
                     "values": out.detach().float().reshape(-1).tolist()}
        else:
            shown = {"type": type(out).__name__}
        rows.append({"case": name, "status": "ran", "secret": secret, "out": shown,
                     "sent": seen["sent"], "collectives": seen["collectives"],
                     "unwatched": seen["error"], "references": list(lab), "ran": ran})
        print("@labkit-row " + json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------ the checker
def check_moe_dispatch(fn: Callable, world_sizes: tuple = (2, 3, 4), timeout: float = 5.0,
                       names: list[str] | None = None) -> list:
    """Check the learner's ``dispatch_combine``: one :class:`Case` per world size and scenario.

    Example::

        lk.exercise.check("09.moe_dispatch", dispatch_combine)     # calls this
    """
    names = list(SCENARIOS) if names is None else list(names)
    cases, stopped = [], ""
    for n in world_sizes:
        labels = [f"{n} ranks, {name}" for name in names]
        if stopped:
            cases += [Case(label, False, stopped) for label in labels]
            continue
        res = run(dispatch_job, n, args=(fn, names), backend="gloo", timeout=timeout,
                  deadline=timeout + 5, check=False, echo=False, fresh=True,
                  env=recorder_env())
        rows = [_rows_of(res[r]) for r in range(n)]
        if any(row.get("status") == "not done" for per in rows for row in per):
            raise NotDone(f"{n} ranks")
        for label, name in zip(labels, names):
            cases.append(Case(label, *_verdict(n, name, names, rows, res)))
        if not res.ok and stuck(res) and _crashed(res) is None:
            stopped = f"not run: the job on {n} ranks deadlocked"
    return cases


def _rows_of(rank) -> list[dict]:
    if rank.ok and isinstance(rank.value, list):
        return rank.value
    return [json.loads(ln[len("@labkit-row "):]) for ln in (rank.stdout or "").splitlines()
            if ln.startswith("@labkit-row ")]


def _verdict(n: int, name: str, names: list[str], rows: list[list[dict]],
             res) -> tuple[bool, str]:
    mine = [next((row for row in per if row["case"] == name), None) for per in rows]
    if any(row is None for row in mine):
        first = next(c for c in names if any(c not in {row["case"] for row in per}
                                             for per in rows))
        if first != name:
            return False, f"not run: the job stopped at scenario {first!r}"
        return False, _job_failure(name, res)
    for r, row in enumerate(mine):
        if row["unwatched"]:
            return False, f"cannot verify on rank {r}: {row['unwatched']}"
    lab = reference_problem([ref for row in mine for ref in row["references"]])
    if lab:
        return False, lab
    for r, row in enumerate(mine):
        other = [c for c in row["collectives"] if c not in _OK_COLLECTIVES]
        if other:
            used = ", ".join(sorted({c.split(":")[-1] for c in other}))
            return False, (f"rank {r} ran {used} while your function ran (gloo's flight "
                           f"recorder lists every collective, whatever route or thread "
                           f"issued it): expert parallelism moves each token only to the "
                           f"rank that holds its expert, with dist.all_to_all_single (the "
                           f"counts, then the tokens, then the results back), not "
                           f"{used} of everything")
    data = [scenario(name, r, n, mine[r]["secret"]) for r in range(n)]
    want = _oracle(data, n)
    for r, row in enumerate(mine):
        problem = _compare(r, row["out"], want[r], data, n)
        if problem:
            return False, problem
    routed = _routed_to(data, n)
    for r, row in enumerate(mine):
        for j, did in enumerate(row["ran"]):
            e = r * data[0]["epr"] + j
            if did > routed[e]:
                return False, (f"rank {r}'s expert {e} ran on {did} rows, and {routed[e]} "
                               f"tokens were routed to it: experts ran on tokens not routed to "
                               f"them (every token on every rank?). Send each rank only the "
                               f"tokens for its experts")
    return _traffic(n, name, mine, data)


def _oracle(data: list[dict], n: int) -> list:
    """Every rank's expected output: each token through its expert, with the owner's weights."""
    import torch
    epr = data[0]["epr"]
    out = []
    for dr in data:
        y = torch.empty_like(dr["tokens"])
        for t, e in enumerate(dr["experts"].tolist()):
            y[t] = expert_rows(data[e // epr]["weights"][e % epr], dr["tokens"][t:t + 1])[0]
        out.append(y)
    return out


def _routed_to(data: list[dict], n: int) -> list[int]:
    import torch
    return torch.bincount(torch.cat([dr["experts"] for dr in data]),
                          minlength=n * data[0]["epr"]).tolist()


def _compare(r: int, shown: dict, want, data: list[dict], n: int) -> str | None:
    """Why rank r's output is wrong, in words (None: right)."""
    import torch
    dr = data[r]
    if "values" not in shown:
        return (f"rank {r}'s dispatch_combine returned {shown.get('type')}, expected a tensor "
                f"[{tuple(want.shape)[0]}, {dr['d']}]: each token's expert output, in token "
                f"order")
    if tuple(shown["shape"]) != tuple(want.shape):
        return (f"rank {r} returned shape {tuple(shown['shape'])}, expected "
                f"{tuple(want.shape)}: one row per token of this rank, in token order")
    got = torch.tensor(shown["values"], dtype=torch.float32).reshape(want.shape)
    if torch.equal(got, want):
        return None
    order = torch.argsort(dr["experts"], stable=True)
    epr = dr["epr"]
    if torch.equal(got, want[order]):
        return (f"rank {r}'s rows are right but in expert order, not token order: row i holds "
                f"the output of token order[i] (tokens sorted by expert). Put them back: "
                f"result[order] = rows (the unsort)")
    if Counter(map(tuple, got.tolist())) == Counter(map(tuple, want.tolist())):
        return (f"rank {r} returned the right rows in the wrong order: after the combine, row i "
                f"belongs to token order[i]; the unsort is result[order] = rows, not "
                f"rows[order]")
    own = torch.stack([expert_rows(dr["weights"][int(e) % epr], dr["tokens"][t:t + 1])[0]
                       for t, e in enumerate(dr["experts"])]) if len(dr["experts"]) else want
    if torch.equal(got, own):
        return (f"rank {r}'s output is its own experts run on its own tokens (expert e read as "
                f"local expert e % experts_per_rank): no token travelled. Expert e's weights "
                f"are only on rank e // experts_per_rank: send the token there")
    if torch.equal(got, dr["tokens"]):
        return f"rank {r} returned its tokens unchanged: no expert ran on them"
    bad = [t for t in range(want.shape[0]) if not torch.equal(got[t], want[t])]
    t = bad[0]
    e = int(dr["experts"][t])
    return (f"rank {r}, token {t} (routed to expert {e} on rank {e // epr}): got "
            f"{_short(got[t])}, expected {_short(want[t])} ({len(bad)} of {want.shape[0]} "
            f"tokens wrong)")


def _short(t) -> str:
    vals = [f"{v:g}" for v in t[:4].tolist()]
    return "[" + ", ".join(vals) + (", …]" if t.numel() > 4 else "]")


def _traffic(n: int, name: str, mine: list[dict], data: list[dict]) -> tuple[bool, str]:
    """Right outputs: did each rank send the rows that had to leave it, no fewer, not many
    more?"""
    epr, d = data[0]["epr"], data[0]["d"]
    E, row = n * epr, 4 * d
    most = 0
    for r, got in enumerate(mine):
        away = sum(1 for e in data[r]["experts"].tolist() if e // epr != r)
        came = sum(1 for s in range(n) if s != r
                   for e in data[s]["experts"].tolist() if e // epr == r)
        need = row * (away + came)
        sent = got["sent"]
        if sent < need:
            return False, (f"side channel: rank {r}'s output is right, but its gloo sockets "
                           f"sent {sent} bytes, fewer than the {need} bytes of the rows that "
                           f"had to leave it ({away} tokens routed to other ranks' experts, "
                           f"{came} results to send back, {row} bytes each): the data went a "
                           f"way that is not a message between ranks (the process group's "
                           f"TCPStore, a file). Move them with dist.all_to_all_single")
        room = 8 * (away + came) + 6 * (n - 1) * (HEADER + 8 * E)
        if name == BYTES and sent > need + room:
            return False, (f"rank {r} sent {sent} bytes; the tokens it routed away and the "
                           f"results it sent back are {need} bytes (plus about "
                           f"{room} for counts, expert ids and gloo's framing): it sent "
                           f"tokens nobody needed. Each rank sends a token only to the rank "
                           f"that holds its expert (input_split_sizes), not every token to "
                           f"everyone")
        most = max(most, sent - need)
    if name == BYTES:
        return True, (f"every output right; each rank sent the rows that had to leave it plus "
                      f"at most {most} bytes of counts and framing")
    return True, "every rank's output equals the one-process oracle"


def _crashed(res):
    return next((r for r in res.ranks if r.status == "signaled"), None)


def _job_failure(name: str, res) -> str:
    """Why the job never reported this scenario, in one sentence."""
    crashed = _crashed(res)
    if crashed is not None and "size doesn't match" in (crashed.stderr or ""):
        return (f"rank {crashed.rank} received more rows from a peer than its "
                f"output_split_sizes had room for, and gloo aborted it ({crashed.signal}): "
                f"output_split_sizes[s] must be what rank s sends you, which only rank s "
                f"knows: exchange the counts first")
    own = next((r for r in res.ranks if r.status == "raised"
                and (r.error or "").startswith("RuntimeError: scenario")
                and error_kind(r.error) == "raised"), None)     # not a peer's timeout or echo
    bad = crashed or own or failure(res)
    if bad is None:
        return f"not run: the job stopped before {name!r}"
    error = clean(bad.error or bad.describe())
    if own is None and stuck(res) and crashed is None:
        return (f"deadlock: rank {bad.rank} waited for a message that never came "
                f"({error[:160]}). Every rank must call each all_to_all_single, even one "
                f"with nothing to send or receive (split sizes of 0)")
    if bad.status == "raised":
        return f"rank {bad.rank} raised {error.removeprefix('RuntimeError: ')[:400]}"
    return error[:300]
