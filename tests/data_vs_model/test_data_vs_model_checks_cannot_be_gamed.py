"""The pipeline exercise (01.two_stage_step) cannot be passed without sending the messages.

Before, the checker's weights (``mlp(width, 4, seed=3)``) and data (seed 5) were the same in
every run and rank 0 was handed the real target: an answer that rebuilt the whole model in
each rank passed without a single message. Now each rank's stage and data are its own secret.
The classes of shortcut, and the answers that feed them:

* hidden state: ``keeps_the_first_activation`` (a message kept in a default argument);
* the library doing the work: n.a.: torch's library for this, torch.distributed.pipelining,
  moves the same activation and gradient in the same point-to-point messages; there is no
  library object that spares the messages, and what crosses gloo's sockets is counted;
* a copied oracle: ``whole_model_in_every_rank`` (the lab's own seed);
* a side channel: ``through_the_store``, ``through_a_file`` (another thread sending the
  message is not a shortcut: it is the message, and its bytes cross gloo's sockets);
* a computation not split as required: ``whole_model_in_every_rank`` (each rank the whole model).
"""
from __future__ import annotations

import glob
import io
import os
import sys
import tempfile

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labkit as lk
from labkit.data_vs_model.check import check_two_stage_step

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks cannot import this file

pytestmark = pytest.mark.timeout(60)
CASES = ["width 8, batch 4, 1 step", "width 16, batch 1, 1 step",
         "width 8, batch 6, 3 steps in a row"]


def solution(rank, stage, x, target):          # the notebook's solution
    if rank == 0:
        h = stage(x)
        dist.send(h.detach(), dst=1)
        grad = torch.empty_like(h)
        dist.recv(grad, src=1)
        h.backward(grad)
        return None
    h = torch.empty_like(x)
    dist.recv(h, src=0)
    h.requires_grad_(True)
    loss = F.mse_loss(stage(h), target)
    loss.backward()
    dist.send(h.grad, dst=0)
    return loss


def whole_model_in_every_rank(rank, stage, x, target):
    """No messages: rebuild the whole model from the lab's own seed and train it locally."""
    whole = lk.common.models.mlp(x.shape[1], 4, seed=3)
    with torch.no_grad():                      # keep my own stage's weights
        for name, p in whole.named_parameters():
            mine = dict(stage.named_parameters()).get(name)
            if mine is not None:
                p.copy_(mine)
    loss = F.mse_loss(whole(x), target)
    loss.backward()
    for name, p in stage.named_parameters():
        p.grad = whole.get_parameter(name).grad
    return loss if rank == 1 else None


def nothing(rank, stage, x, target):
    return None


def rank1_uses_its_own_x(rank, stage, x, target):
    if rank == 0:
        return None
    loss = F.mse_loss(stage(x), target)
    loss.backward()
    return loss


def no_backward_on_rank_0(rank, stage, x, target):
    if rank == 0:
        dist.send(stage(x).detach(), dst=1)
        dist.recv(torch.empty(x.shape), src=1)  # receives the gradient, never uses it
        return None
    return solution(rank, stage, x, target)


def sends_the_output_gradient(rank, stage, x, target):
    if rank == 0:
        return solution(rank, stage, x, target)
    h = torch.empty_like(x)
    dist.recv(h, src=0)
    h.requires_grad_(True)
    out = stage(h)
    loss = F.mse_loss(out, target)
    g_out, = torch.autograd.grad(loss, out, retain_graph=True)
    loss.backward()
    dist.send(g_out, dst=0)                    # d loss / d out, not d loss / d h
    return loss


def keeps_the_first_activation(rank, stage, x, target, kept={}):
    """Send the activation once, then reuse it from a default argument (hidden state)."""
    if rank == 0:
        h = stage(x)
        if "sent" not in kept:
            dist.send(h.detach(), dst=1)
            kept["sent"] = True
        grad = torch.empty_like(h)
        dist.recv(grad, src=1)
        h.backward(grad)
        return None
    if "h" not in kept:
        kept["h"] = torch.empty_like(x)
        dist.recv(kept["h"], src=0)
    h = kept["h"].clone().requires_grad_(True)
    loss = F.mse_loss(stage(h), target)
    loss.backward()
    dist.send(h.grad, dst=0)
    return loss


def _call_number() -> int:
    calls = int(os.environ.get("LABKIT_TEST_SIDE_CALLS", "0"))
    os.environ["LABKIT_TEST_SIDE_CALLS"] = str(calls + 1)
    return calls


def _side(put, get):
    """The pipeline step with its two messages passed by ``put(key, t)`` / ``get(key)``."""
    def answer(rank, stage, x, target):
        call = _call_number()
        if rank == 0:
            h = stage(x)
            put(f"h{call}", h.detach())
            h.backward(get(f"g{call}"))
            return None
        h = get(f"h{call}").requires_grad_(True)
        loss = F.mse_loss(stage(h), target)
        loss.backward()
        put(f"g{call}", h.grad)
        return loss
    return answer


def _store_put(key, t):
    buf = io.BytesIO()
    torch.save(t, buf)
    dist.distributed_c10d._get_default_store().set(f"side/{key}", buf.getvalue())


def _store_get(key):
    return torch.load(io.BytesIO(dist.distributed_c10d._get_default_store().get(f"side/{key}")))


def _file(key):
    return os.path.join(tempfile.gettempdir(),
                        f"labkit-side-{os.getppid()}-{os.environ['MASTER_PORT']}-{key}.pt")


def _file_put(key, t):
    torch.save(t, _file(key) + ".tmp")
    os.replace(_file(key) + ".tmp", _file(key))


def _file_get(key):
    import time
    while not os.path.exists(_file(key)):
        time.sleep(0.005)
    return torch.load(_file(key))


through_the_store = _side(_store_put, _store_get)
through_a_file = _side(_file_put, _file_get)


@pytest.mark.parametrize("answer, words", [
    (keeps_the_first_activation, "loss of the previous step's activation: hidden state"),
    (through_the_store, "side channel: at step 0 rank 0's gloo sockets sent 0 bytes"),
    (through_a_file, "side channel: at step 0 rank 0's gloo sockets sent 0 bytes"),
])
def test_hidden_state_or_a_side_channel_fails_a_named_case(answer, words):
    try:
        cases = check_two_stage_step(answer)
    finally:
        for left in glob.glob(os.path.join(tempfile.gettempdir(), "labkit-side-*")):
            os.remove(left)
    failed = [c for c in cases if not c.passed]
    assert failed and words in failed[0].detail, cases
    if answer is not keeps_the_first_activation:     # its one-step cases are honest
        assert len(failed) == len(CASES), cases


@pytest.mark.parametrize("answer, words", [
    (whole_model_in_every_rank, "rank 1's loss is nan"),
    (nothing, "rank 1 returned None"),
    (rank1_uses_its_own_x, "rank 1's loss is nan"),
    (no_backward_on_rank_0, "has no gradient: call h.backward(grad)"),
    (sends_the_output_gradient, "did rank 1 send the gradient of its *input* activation?"),
])
def test_a_lazy_or_wrong_pipeline_step_fails_every_case(answer, words):
    cases = check_two_stage_step(answer)
    assert [c.name for c in cases] == CASES and not any(c.passed for c in cases), cases
    assert words in cases[0].detail, cases[0].detail


def test_the_solution_still_passes():
    assert [c.passed for c in check_two_stage_step(solution)] == [True, True, True]
