"""Claim tests for notebook 09's activation sections (§1-§3): each reproduces, on the pinned torch
2.13.0 and gloo, a sentence the notebook says about torch or gloo. The docstring names the
section and quotes the sentence (``09 "§N": “...”``); the last test checks that every quoted
sentence is still in solutions/09_*.ipynb (before the notebook is assembled: in the fragment
/tmp/nb09/activations.ipynb, when it exists). When one fails after a torch upgrade, the sentence
is wrong for the new version: fix the prose, then the test.
"""
from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import _claims
import labkit as lk

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = Path("/tmp/nb09/activations.ipynb")


def _saved(fn, *args):
    """``(result, [(tensor, storage address, storage bytes)])`` of what autograd packs in fn."""
    seen = []

    def pack(t):
        seen.append((t, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, seen


# ------------------------------------------------------------------ §1 saved_tensors_hooks
def test_pack_runs_as_each_operation_saves_and_unpack_in_backward():
    """09 "§1": “autograd calls `pack` with every tensor an operation saves for its backward, at
    the moment it saves it, and calls `unpack` when the backward needs it back”."""
    events = []

    def pack(t):
        events.append("pack")
        return t

    def unpack(t):
        events.append("unpack")
        return t
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = torch.sin(x)                          # keeps x
        events.append("after sin")
        z = torch.exp(y)                          # keeps its result
        events.append("after exp")
    assert events == ["pack", "after sin", "pack", "after exp"]
    z.sum().backward()
    assert events[4:] == ["unpack", "unpack"]


def test_a_linear_on_a_3d_input_saves_a_2d_view_of_it():
    """09 "§1": “a linear on a `[s, b, h]` input saves a 2-D view of its input, sharing its
    storage”."""
    lin = torch.nn.Linear(8, 16)
    x = torch.randn(5, 3, 8, requires_grad=True)
    _, seen = _saved(lin, x)
    params = {p.untyped_storage().data_ptr() for p in lin.parameters()}
    inputs = [(t, ptr) for t, ptr, _ in seen if ptr not in params]
    assert len(inputs) == 1
    t, ptr = inputs[0]
    assert t.shape == (15, 8) and ptr == x.untyped_storage().data_ptr()


def test_layer_norm_keeps_its_input_and_two_fp32_numbers_per_token():
    """09 "§1": “`F.layer_norm` keeps its input and, per token, its mean and 1/σ in fp32”."""
    x = torch.randn(6, 2, 16, requires_grad=True)
    w, b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    _, seen = _saved(lambda x: F.layer_norm(x, (16,), w, b, 1e-5), x)
    others = [t for t, ptr, _ in seen if ptr not in {p.untyped_storage().data_ptr()
                                                    for p in (w, b)}]
    assert others[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    mean, rstd = others[1:]
    assert mean.shape == rstd.shape == (6, 2, 1) and mean.dtype == rstd.dtype == torch.float32
    assert torch.allclose(mean.flatten(), x.detach().mean(-1).flatten(), atol=1e-6)
    assert torch.allclose(rstd.flatten(), 1 / torch.sqrt(x.detach().var(-1, unbiased=False)
                                                         + 1e-5).flatten(), atol=1e-4)


def test_dropout_on_cpu_keeps_a_mask_of_the_input_dtype():
    """09 "§1": “On CPU, `F.dropout` keeps a mask of the input's dtype: 4 bytes per element in
    fp32”."""
    x = torch.randn(1000, requires_grad=True)
    _, seen = _saved(lambda x: F.dropout(x, 0.1, True), x)
    assert len(seen) == 1
    mask, _, nbytes = seen[0]
    assert mask.dtype == torch.float32 and nbytes == 4 * 1000
    assert set(torch.unique(mask).tolist()) <= {0.0, torch.tensor(1 / 0.9).item()}  # scaled keep


def test_cpu_sdpa_keeps_no_s_by_s_tensor():
    """09 "§1": “`F.scaled_dot_product_attention` on this CPU build (fp32, no dropout,
    `is_causal=True`) keeps q, k, v, its output and one number per query and head (the log of its
    softmax's denominator, §5): no s × s tensor”."""
    b, heads, s, d = 2, 3, 32, 8
    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    out, seen = _saved(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       q, k, v)
    ptrs = [ptr for _, ptr, _ in seen]
    for t in (q, k, v, out):
        assert t.untyped_storage().data_ptr() in ptrs
    shapes = sorted(tuple(t.shape) for t, _, _ in seen)
    assert shapes.count((b, heads, s)) == 1 and len(seen) == 5     # the log-sum-exp
    assert all(t.numel() < s * s * b * heads for t, _, _ in seen)
    # the same call with dropout keeps s × s tensors (the math path): the claim's "no dropout"
    _, with_dropout = _saved(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, dropout_p=0.1), q, k, v)
    assert any(t.numel() >= s * s * b * heads for t, _, _ in with_dropout)


# ------------------------------------------------------------------ §2 checkpoint
def test_checkpoint_keeps_nothing_of_fn_shows_only_its_inputs_and_reruns_fn():
    """09 "§2": “In forward it runs `fn` under saved-tensor hooks of its own, which keep nothing
    of what `fn`'s operations save: an outer `saved_tensors_hooks` sees none of what `fn`'s
    operations save, only `fn`'s inputs.” Also 09 "§2": “In backward, when the first dropped
    tensor is needed, it runs `fn`'s forward again.”"""
    calls, inner = [], []

    def fn(x):
        calls.append(1)
        e = torch.exp(x)                          # saved by exp (its result) and by sin
        inner.append(weakref.ref(e))
        return torch.sin(e)
    x = torch.randn(64, requires_grad=True)
    plain, seen_plain = _saved(fn, x)
    gc.collect()
    assert inner[0]() is not None                 # without checkpoint, autograd keeps it
    assert len(seen_plain) == 2
    y, seen = _saved(lambda x: checkpoint(fn, x, use_reentrant=False), x)
    gc.collect()
    assert inner[1]() is None                     # ... with it, nothing keeps it
    assert [ptr for _, ptr, _ in seen] == [x.untyped_storage().data_ptr()]
    assert len(calls) == 2
    y.sum().backward()
    assert len(calls) == 3                        # fn ran again in backward
    g = x.grad.clone()
    x.grad = None
    plain.sum().backward()
    assert torch.equal(g, x.grad)


# ------------------------------------------------------------------ §3 gloo's bytes
def _wire(rank, world_size):
    import torch.distributed as dist

    from labkit.grading.watch import Watch
    from labkit.sharding import ring_all_gather
    w, out = Watch(), {}
    S = 1024 * world_size
    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single", "ring_all_gather"):
        t = torch.randn(S)
        dist.barrier()
        w.start()
        if name == "all_reduce":
            dist.all_reduce(t)
        elif name == "reduce_scatter_single":
            dist.reduce_scatter_single(torch.empty(S // world_size), t)
        elif name == "all_gather_single":
            dist.all_gather_single(torch.empty(S), t[:S // world_size].clone())
        else:
            ring_all_gather(t[:S // world_size].clone())
        out[name] = w.stop()
    return 4 * S, out


@pytest.mark.parametrize("n", [2, 4])
def test_gloo_sends_a_whole_all_reduce_for_a_reduce_scatter_and_the_ring_144_per_message(n):
    """09 "§3": “on gloo, torch 2.13 runs `reduce_scatter_single` as an all-reduce of the whole
    tensor, so torch's own reduce-scatter would send more here”. Also 09 "§3": “every message
    costs 144 bytes of framing on the sockets besides its payload”."""
    for S, seen in lk.run(_wire, n, timeout=60, echo=False).values:
        assert seen["reduce_scatter_single"]["collectives"] == ["gloo:all_reduce"]
        assert seen["reduce_scatter_single"]["sent"] == seen["all_reduce"]["sent"]
        assert seen["reduce_scatter_single"]["sent"] > 1.9 * seen["all_gather_single"]["sent"]
        assert seen["ring_all_gather"]["sent"] == (n - 1) * S // n + 144 * (n - 1)


# ------------------------------------------------------------------ the quotes
def _fragment_text() -> str:
    nb = nbformat.read(FRAGMENT, as_version=4)
    return _claims._norm("\n".join(c.source for c in nb.cells))


def test_the_lab_says_what_these_tests_show():
    if list((ROOT / "solutions").glob("09_*.ipynb")):
        _claims.check_quotes(sys.modules[__name__])
    elif FRAGMENT.exists():          # before the lead assembles notebook 09: this part's fragment
        text = _fragment_text()
        for name, where, sentence in _claims.quotes(sys.modules[__name__]):
            assert where == "09" and sentence in text, (name, sentence)
    else:
        pytest.skip("notebook 09 is not assembled yet (solutions/09_*.ipynb)")
