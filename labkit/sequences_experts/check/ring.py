"""Checking the learner's ring attention: notebook 09's build, ``09.ring_attention``.

The learner writes ``ring_attention(q, k, v, causal)``, inside a rank: ``q``, ``k``, ``v`` are
this rank's block ``[heads, block_len, head_dim]`` of a sequence cut in N contiguous blocks in
rank order (rank r holds positions ``r·B`` to ``(r+1)·B - 1``), and it returns this rank's block
of the attention output, forward only. It may use ``SX.attention.attention_lse`` (the
one-process oracle, :func:`labkit.sequences_experts.attention.attention_lse`) on one block at a
time, and ``dist.isend``/``dist.irecv`` (or ``lk.collectives.send_right_recv_left``) to its
neighbours.

Each world size (2, 3, 4) runs one fresh gloo job; in it every rank calls the answer twice, not
causal then causal, each call on new inputs (so a call that reuses what an earlier one kept
fails the second), and each call is a case. A case passes only if, on **every rank**:

* the output equals the one-process oracle
  (:func:`~labkit.sequences_experts.attention.attention_lse` on the whole sequence, rebuilt
  from the inputs the ranks report after they ran) within
  :data:`TOLERANCE` = 1e-5 absolute. Why that bound: the outputs are averages of values drawn
  from N(0, 1), so of order 1, where fp32 rounds at about 6e-8; the ring adds its blocks in
  another order and rescales each by ``exp(lse_a - lse)``, a few roundings per merge, and the
  lab's own ring stays under 2e-6 on 4 ranks. A merge without the log-sum-exp rescale, or a
  causal mask one block off, is off by 1e-2 or more. Wrong outputs are matched against the
  usual mistakes (:func:`mistakes`: a plain average or sum of the blocks' outputs, only the
  rank's own block, the diagonal block unmasked or left out, the block held at step s taken
  for another one) and the case names the one that fits;
* **no collective** ran (gloo's flight recorder lists any, by any route: an ``all_gather`` of
  the keys and values is gathering the whole sequence, not a ring);
* every message went **to the right neighbour** and came **from the left one** (the
  dispatcher's record of every ``isend``/``irecv``/``send``/``recv``: a rank that sends its
  block to every other rank gathers the whole sequence with point-to-point messages);
* no attention product spans the **whole sequence**: on 3 and 4 ranks, no matrix product or
  SDPA call inside the answer has a dimension over two blocks (a rank that got every block and
  then ran ``F.scaled_dot_product_attention`` or the oracle on all of them fails, however the
  blocks arrived);
* the bytes on gloo's sockets are **at least** this rank's own K and V (non-causal; causal:
  every rank but the last, whose keys nobody needs) — fewer, and the data went another way,
  the store or a file, a side channel — and **at most** the ring's N - 1 K/V blocks plus
  gloo's framing (:data:`HEADERS_PER_STEP` messages' worth per step);
* the lab's own ring (``SX.attention.ring_attention``, ``SX.attention.merge_partials`` and the
  other :func:`~labkit.grading.references.reference` functions of ``labkit.sequences_experts``) did
  not run inside the answer.

Each rank draws its inputs from a secret only it holds (``os.urandom``), new for every call, so
a copy of the oracle with fixed seeds computes the wrong numbers, and no rank can know another's
keys without receiving them.

What stays out of reach (as in :mod:`labkit.grading.watch`): code in the rank can rewrite the
checker; the width of attention products is watched in the thread that called the answer (a
dispatch mode is per thread), so a ring that hands its blocks to a helper thread to compute on
all of them at once is not told apart by that rule; and bytes are counted, not read.
"""
from __future__ import annotations

import os
from typing import Callable

from ...grading.exercise import Case, NotDone
from ...grading.references import reference_problem, references_used
from ...grading.watch import Watch
from ...runtime import run
from ...collectives.check.runs import HEADER_BYTES, clean, failure, recorder_env, stuck

__all__ = ["TOLERANCE", "SHAPE", "HEADERS_PER_STEP", "ring_job", "oracle_blocks", "mistakes",
           "check_ring_attention"]

TOLERANCE = 1e-5
SHAPE = {"heads": 2, "block": 16, "head_dim": 16}      # one K/V block: 2 KiB
HEADERS_PER_STEP = 4          # messages per step allowed for (K and V apart, and a little more)
CALLS = (False, True)          # causal, in the order every job calls the answer
_LAB = ("labkit.sequences_experts.",)
_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "dot", "vdot", "mv"}
_SDPA = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_attention_math_for_mps", "_flash_attention_forward",
         "_efficient_attention_forward"}


def _span_mode():
    """A dispatch mode that notes the widest operand of every matrix product and attention
    kernel run under it: ``(size, op, shapes)`` of the widest (the key length for SDPA)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Spans(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.widest = (0, "", "")

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op = func._schema.name.split("::")[-1]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if op in _MATMULS:
                outs = [out] if isinstance(out, torch.Tensor) else []
                sizes = [d for t in tensors + outs for d in t.shape[-2:]]
            elif op in _SDPA and len(tensors) >= 2:
                sizes = [tensors[1].shape[-2]]
            else:
                return out
            if sizes and max(sizes) > self.widest[0]:
                self.widest = (int(max(sizes)), op,
                               " × ".join(str(tuple(t.shape)) for t in tensors[:3]))
            return out

    return Spans()


def ring_job(rank: int, world_size: int, fn: Callable, heads: int, block: int,
             head_dim: int) -> dict:
    """In every rank: call ``fn`` on fresh secret inputs once per entry of :data:`CALLS`, and
    record what came back with what the rank did meanwhile.

    Returns ``{"not done": True}`` for a stub, else ``{"calls": [...]}``, each ``{"causal",
    "q", "k", "v", "out", "error", "sent", "collectives", "unwatched", "references", "peers",
    "widest"}``. A call that raised ends the job's calls on this rank.
    """
    import torch

    from ...runtime.commtrace import CommRecorder
    from .. import attention  # noqa: F401  (SX.attention.attention_lse, for the answer to call)
    watcher = Watch()                             # all ranks together: it runs one all_reduce
    calls = []
    for causal in CALLS:
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        q, k, v = (torch.randn(heads, block, head_dim, generator=g) for _ in range(3))
        spans, error, out = _span_mode(), "", None
        watcher.start()
        try:
            with references_used(*_LAB) as lab, CommRecorder() as rec, spans:
                out = fn(q.clone(), k.clone(), v.clone(), causal)
        except NotImplementedError:
            return {"not done": True}
        except Exception as exc:  # noqa: BLE001  (the answer's failure is the case's detail)
            error = f"{type(exc).__name__}: {clean(str(exc)).strip()[:300]}"
        seen = watcher.stop()
        if isinstance(out, torch.Tensor):
            out = out.detach().clone()
        elif out is not None or not error:
            out = f"{type(out).__name__}"
        calls.append(dict(causal=causal, q=q, k=k, v=v, out=out, error=error,
                          sent=seen["sent"], collectives=seen["collectives"],
                          unwatched=seen["error"], references=list(lab),
                          peers=[(r["kind"], r["peer"]) for r in rec.records
                                 if r["kind"] in ("send", "recv")],
                          widest=spans.widest))
        if error:
            break
    return {"not done": False, "calls": calls}


# ------------------------------------------------------------------ the oracle and the mistakes
def oracle_blocks(qs: list, ks: list, vs: list, causal: bool) -> list:
    """Each rank's block of the one-process attention over the whole sequence."""
    import torch

    from ..attention import attention_lse
    n = len(qs)
    out, _ = attention_lse(torch.cat(qs, -2), torch.cat(ks, -2), torch.cat(vs, -2), causal=causal)
    return list(out.chunk(n, dim=-2))


def _simulate(qs, ks, vs, causal, label=None, merge="lse", diagonal="mask", steps=None):
    """A ring as a mistaken answer runs it, in one process: at step s rank r holds block
    (r - s) mod n and believes it is ``label(r, s, n)``; ``merge`` "lse" (right), "mean" or
    "sum"; ``diagonal`` "mask" (right), "full" (not masked) or "skip" (left out); ``steps``:
    how many blocks it uses (default all n)."""
    import torch

    from ..attention import attention_lse
    n = len(qs)
    label = label or (lambda r, s, n: (r - s) % n)
    result = []
    for r in range(n):
        parts = []
        for s in range(n if steps is None else steps):
            held, j = (r - s) % n, label(r, s, n)
            if causal and j > r:
                continue
            diag = causal and j == r
            if diag and diagonal == "skip":
                continue
            parts.append(attention_lse(qs[r], ks[held], vs[held],
                                   causal=diag and diagonal == "mask"))
        if not parts:
            result.append(torch.zeros_like(qs[r]))
            continue
        if merge == "lse":
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
            result.append(sum(torch.exp(p[1] - lse).unsqueeze(-1) * p[0] for p in parts))
        elif merge == "mean":
            result.append(sum(p[0] for p in parts) / len(parts))
        else:
            result.append(sum(p[0] for p in parts))
    return result


def mistakes(qs: list, ks: list, vs: list, causal: bool) -> dict:
    """What the usual wrong answers return, per rank: ``{description: [block per rank]}``."""
    out = {
        "wrong merge (no log-sum-exp rescale): your output is the plain average of the "
        "blocks' outputs. Each block's output is normalised by its own softmax denominator: "
        "weigh it by exp(lse_block - lse_total), with lse_total = logaddexp of the parts":
            _simulate(qs, ks, vs, causal, merge="mean"),
        "wrong merge (no log-sum-exp rescale): your output is the sum of the blocks' "
        "normalised outputs. Weigh each by exp(lse_block - lse_total), with lse_total = "
        "logaddexp of the parts":
            _simulate(qs, ks, vs, causal, merge="sum"),
        "only this rank's own block of keys counts in your output: the blocks that arrived "
        "were not merged in":
            _simulate(qs, ks, vs, causal, steps=1),
    }
    if causal:
        out.update({
            "wrong causal mask (off by one block): the diagonal block (this rank's own keys) "
            "was used unmasked; only it needs the causal mask":
                _simulate(qs, ks, vs, causal, diagonal="full"),
            "wrong causal mask (off by one block): the diagonal block (this rank's own keys) "
            "was left out; a query sees its own position and the ones before it":
                _simulate(qs, ks, vs, causal, diagonal="skip"),
            "wrong causal mask (off by one block): at step s this rank holds the block of rank "
            "(r - s) mod n, and your mask treated it as rank (r + s) mod n's":
                _simulate(qs, ks, vs, causal, label=lambda r, s, n: (r + s) % n),
            "wrong causal mask (off by one block): at step s this rank holds the block of rank "
            "(r - s) mod n, and your mask treated it as rank (r - s - 1) mod n's":
                _simulate(qs, ks, vs, causal, label=lambda r, s, n: (r - s - 1) % n),
            "wrong causal mask (off by one block): at step s this rank holds the block of rank "
            "(r - s) mod n, and your mask treated it as rank (r - s + 1) mod n's":
                _simulate(qs, ks, vs, causal, label=lambda r, s, n: (r - s + 1) % n),
        })
    return out


# ------------------------------------------------------------------ the checker
def check_ring_attention(fn: Callable, world_sizes: tuple = (2, 3, 4), timeout: float = 5.0,
                         shape: dict | None = None) -> list:
    """Check the learner's ``fn(q, k, v, causal)``: one :class:`Case` per world size and
    causal flag, each world size one fresh gloo job (module docstring). A deadlock fails that
    job's cases within ``timeout`` seconds and skips the larger world sizes.

    Example::

        lk.exercise.check("09.ring_attention", ring_attention)   # calls this
    """
    shape = dict(SHAPE if shape is None else shape)
    cases, stopped = [], ""
    for n in world_sizes:
        labels = [f"{n} ranks, {'causal' if c else 'not causal'}" for c in CALLS]
        if stopped:
            cases += [Case(label, False, stopped) for label in labels]
            continue
        res = run(ring_job, n, args=(fn, shape["heads"], shape["block"], shape["head_dim"]),
                  backend="gloo", timeout=timeout, deadline=timeout + 5, check=False,
                  echo=False, fresh=True, env=recorder_env())
        if any((r.ok and isinstance(r.value, dict) and r.value.get("not done"))
               or (r.error or "").startswith("NotImplementedError") for r in res.ranks):
            raise NotDone(labels[0])
        for i, label in enumerate(labels):
            cases.append(Case(label, *_verdict(n, i, res, shape)))
        if not res.ok and stuck(res) or any("deadlock" in c.detail for c in cases[-2:]):
            stopped = f"not run: the job on {n} ranks deadlocked"
    return cases


def _verdict(n: int, i: int, res, shape: dict) -> tuple[bool, str]:
    """(passed, detail) of call ``i`` of a job on ``n`` ranks."""
    import torch
    if not res.ok:
        return False, _job_failure(res)
    calls = [res[r].value.get("calls", []) if isinstance(res[r].value, dict) else []
             for r in range(n)]
    if any(len(c) <= i for c in calls):
        errors = [(r, c[-1]["error"]) for r, c in enumerate(calls) if c and c[-1]["error"]]
        if errors:
            return False, _call_error(errors, earlier=True)
        return False, "cannot verify: a rank returned no record of this call"
    here = [c[i] for c in calls]
    errors = [(r, c["error"]) for r, c in enumerate(here) if c["error"]]
    if errors:
        return False, _call_error(errors)
    for r, c in enumerate(here):
        if c["unwatched"]:
            return False, f"cannot verify on rank {r}: {c['unwatched']}"
    lab = reference_problem([ref for c in here for ref in c["references"]])
    if lab:
        return False, lab
    for r, c in enumerate(here):
        if c["collectives"]:
            used = ", ".join(sorted({x.split(":")[-1] for x in c["collectives"]}))
            return False, (f"gathering the whole sequence: rank {r} ran a collective ({used}). "
                           f"gloo's flight recorder lists every collective, whatever called it "
                           f"(dist.all_gather, a process group's method, a thread). In ring "
                           f"attention a rank holds one K/V block at a time and passes it to "
                           f"its right neighbour: dist.isend / dist.irecv")
    for r, c in enumerate(here):
        right, left = (r + 1) % n, (r - 1) % n
        odd = [(kind, peer) for kind, peer in c["peers"]
               if (kind == "send" and peer != right) or (kind == "recv" and peer != left)]
        if odd:
            kind, peer = odd[0]
            return False, (f"gathering the whole sequence: rank {r} "
                           f"{'sent to' if kind == 'send' else 'received from'} rank {peer}. "
                           f"A ring sends only to its right neighbour, rank {right}, and "
                           f"receives only from its left one, rank {left}; K/V blocks reach "
                           f"the others by being passed on")
    if n >= 3:
        for r, c in enumerate(here):
            size, op, shapes = c["widest"]
            if size > 2 * shape["block"]:
                return False, (f"attention over the whole sequence: rank {r} ran {op} on "
                               f"{shapes}, {size} positions wide, where one block is "
                               f"{shape['block']}: a rank that has every block and computes "
                               f"with all of them at once holds the whole sequence's keys "
                               f"(F.scaled_dot_product_attention or the oracle on the "
                               f"concatenated blocks). Compute each block as it arrives and "
                               f"merge")
    for r, c in enumerate(here):
        out = c["out"]
        if not isinstance(out, torch.Tensor):
            return False, (f"rank {r} returned {out}, not a tensor: return this rank's output "
                           f"block, shaped like q")
        if tuple(out.shape) != tuple(c["q"].shape):
            return False, (f"rank {r} returned a tensor of shape {tuple(out.shape)}; this "
                           f"rank's output block has q's shape {tuple(c['q'].shape)}")
    qs, ks, vs = ([c[x] for c in here] for x in ("q", "k", "v"))
    causal = here[0]["causal"]
    want = oracle_blocks(qs, ks, vs, causal)
    got = [c["out"].float() for c in here]
    errs = [float((g - w).abs().max()) if torch.isfinite(g).all() else float("inf")
            for g, w in zip(got, want)]
    if max(errs) > TOLERANCE:
        return False, _diagnose(got, want, errs, qs, ks, vs, causal, shape["block"])
    problem = _traffic(n, here, shape, causal)
    if problem:
        return False, problem
    return True, (f"every rank within {max(errs):.1e} of the one-process oracle "
                  f"(tolerance {TOLERANCE:g}); rank 0 sent {here[0]['sent']:,} bytes")


def _diagnose(got, want, errs, qs, ks, vs, causal, block) -> str:
    """Why the outputs differ from the oracle: a known mistake if one fits, else where."""
    for description, blocks in mistakes(qs, ks, vs, causal).items():
        if all(float((g - b).abs().max()) <= TOLERANCE for g, b in zip(got, blocks)):
            return description
    import torch
    r = next(i for i, e in enumerate(errs) if e > TOLERANCE)
    diff = (got[r] - want[r]).abs()
    if not torch.isfinite(diff).all():
        return (f"rank {r}'s output has NaN or inf values: a merge of two empty parts, or "
                f"exp of a large number? (merge with torch.logaddexp)")
    row = int(diff.amax(dim=(0, 2)).argmax())
    right = [i for i, e in enumerate(errs) if e <= TOLERANCE]
    return (f"rank {r}'s output is off by up to {errs[r]:.3g} (query position "
            f"{r * block + row} of the sequence, row {row} of its block); ranks "
            f"{right or 'none'} match the oracle")


def _traffic(n: int, here: list, shape: dict, causal: bool) -> str | None:
    """Right numbers: did each rank send its own K/V (at least) and no more than a ring's?"""
    kv = 2 * shape["heads"] * shape["block"] * shape["head_dim"] * 4
    most = (n - 1) * (kv + HEADERS_PER_STEP * HEADER_BYTES)
    for r, c in enumerate(here):
        must = 0 if causal and r == n - 1 else kv
        if c["sent"] < must:
            return (f"side channel: rank {r}'s output is right, but its gloo sockets sent "
                    f"{c['sent']} bytes, fewer than its own K and V ({kv} bytes), which "
                    f"{'the later ranks' if causal else 'every other rank'} needed: the keys "
                    f"went some way that is not a message between ranks (the process "
                    f"group's TCPStore, a file). Pass them with dist.isend / dist.irecv")
        if c["sent"] > most:
            return (f"gathering the whole sequence: rank {r} sent {c['sent']:,} bytes, more "
                    f"than a ring's N - 1 = {n - 1} K/V blocks of {kv:,} bytes (with gloo's "
                    f"framing, at most {most:,}): a ring passes one block per step")
    return None


def _call_error(errors: list, earlier: bool = False) -> str:
    """The rank whose own error explains a failed call (a timeout is a peer's echo)."""
    own = [(r, e) for r, e in errors if "Timed out" not in e and "Connection" not in e]
    r, e = (own or errors)[0]
    if not own:
        return (f"deadlock: rank {r} waited for a message that never came ({e[:160]}). Every "
                f"irecv needs the matching isend on the left neighbour, in the same step")
    return f"{'an earlier call: ' if earlier else ''}rank {r} raised {e}"


def _job_failure(res) -> str:
    bad = failure(res)
    if bad is None:
        return "no result from some ranks"
    if stuck(res):
        return (f"deadlock: rank {bad.rank} waited for a message that never came "
                f"({clean(bad.error or bad.describe())[:160]})")
    if bad.status == "raised":
        return f"rank {bad.rank} raised {clean(bad.error or '')[:300]}"
    return clean(bad.describe())[:300]
