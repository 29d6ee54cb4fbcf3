"""Claim tests for notebook 06: each reproduces, on the pinned torch 2.13.0 and gloo, a sentence
the notebook says about torch. The docstring names the section and quotes the sentence
(``06 "§N": “...”``); the last test checks that every quoted sentence is still in
solutions/06_sharding.ipynb, so the prose and its test cannot drift apart. When one fails after
a torch upgrade, the sentence is wrong for the new version: fix the prose, then the test.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

import _claims
import labkit as lk
from conftest import needs_gpus

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _run(fn, world_size=2, **kw):
    return lk.run(fn, world_size, timeout=60, echo=False, **kw).values


# ------------------------------------------------------------------ §1 memory
def test_adam_keeps_a_4_byte_step_counter_per_parameter_tensor():
    """06 "§1": “24 bytes of Adam `step` counters (a 4-byte fp32 scalar for each of the 6
    parameter tensors)”."""
    model = lk.sharding.model.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    steps = [s["step"] for s in opt.state.values()]
    assert len(steps) == 6 and all(t.dtype == torch.float32 and t.dim() == 0 for t in steps)
    assert sum(t.untyped_storage().nbytes() for t in steps) == 24


def test_gradient_as_bucket_view_makes_the_gradients_the_buckets():
    """06 "§1": “With `gradient_as_bucket_view=True` the gradients' own storage disappears: they
    *are* the buckets.”"""
    default, view = _run(lambda r, w: [lk.sharding.ddp_memory(r, w, gradient_as_bucket_view=v)
                                       for v in (False, True)])[0]
    assert not default["grads_in_buckets"] and default["measured"]["grads"] == 4 * default["psi"]
    assert view["grads_in_buckets"] and view["measured"]["grads"] == 0
    assert view["measured"]["buckets"] == 4 * view["psi"]


# ------------------------------------------------------------------ §3 the counter
def _counted_kinds(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.sharding import CommCounter, ring_all_gather
    from labkit.sharding.library import TorchFSDP
    seen = {}
    model = DDP(torch.nn.Linear(4, 3))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    with CommCounter() as c:
        model(torch.randn(2, 4)).sum().backward()
    seen["DDP backward"] = c.kinds()
    with CommCounter() as c:
        opt.step()
    seen["ZeroRedundancyOptimizer.step"] = c.kinds()
    with CommCounter() as c:
        ring_all_gather(torch.ones(3))
    seen["ring_all_gather"] = c.kinds()
    fsdp = TorchFSDP(lk.sharding.model.make_mlp((4, 6, 2)))
    with CommCounter() as c:
        fsdp.module(torch.randn(2, 4)).sum().backward()
    seen["FSDP2 step"] = c.kinds()
    dist.barrier()
    return seen


def test_the_counter_sees_every_kind_of_collective_whoever_issues_it():
    """06 "§3": “a PyTorch dispatch mode that sees every `torch.distributed` operation a rank's
    threads issue, with its payload”: the ring's sends, DDP's,
    `ZeroRedundancyOptimizer`'s and FSDP2's collectives."""
    seen = _run(_counted_kinds)[0]
    assert seen == {"DDP backward": ["all_reduce"], "ZeroRedundancyOptimizer.step": ["broadcast"],
                    "ring_all_gather": ["send", "recv"],
                    "FSDP2 step": ["all_gather", "reduce_scatter"]}


# ------------------------------------------------------------------ §5 PyTorch's own
def _fsdp_grads(rank, world_size, reshard, mixed):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from labkit.sharding.model import global_batch, linears, make_mlp, rank_batch
    mesh = init_device_mesh("cpu", (world_size,))
    model, ref = make_mlp((8, 16, 4), seed=0), make_mlp((8, 16, 4), seed=0)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed else MixedPrecisionPolicy()
    for layer in linears(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    x, y = rank_batch(rank, world_size, 4, (8, 16, 4))
    with CommDebugMode() as cdm:
        F.mse_loss(model(x), y).backward()
    X, Y = global_batch(4 * world_size, (8, 16, 4))
    F.mse_loss(ref(X), Y).backward()
    diff = max(float((p.grad.full_tensor() - q.grad).abs().max())
               for p, q in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "counts": {str(k): v for k, v in cdm.get_comm_counts().items()}}


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_gradients_equal_one_process_on_gloo(world_size):
    """06 "§8": “On torch 2.13.0 they are equal (a claim test keeps checking).”"""
    assert torch.__version__.startswith("2.13.0")
    for reshard in (True, False):
        values = _run(lambda r, w: _fsdp_grads(r, w, reshard, False), world_size)
        assert max(v["diff"] for v in values) < 1e-6, (reshard, values)


def test_reshard_after_forward_false_halves_the_all_gathers():
    """06 "§5": “`reshard_after_forward=False` halves its all-gathers.”"""
    true, false = (_run(lambda r, w: _fsdp_grads(r, w, reshard, False))[0]["counts"]
                   for reshard in (True, False))
    assert true == {"c10d._allgather_base_": 4, "c10d._reduce_scatter_base_": 2}
    assert false == {"c10d._allgather_base_": 2, "c10d._reduce_scatter_base_": 2}


def test_a_bf16_mixed_precision_policy_runs_on_gloo_and_stays_close():
    """06 "§10": “bf16 compute with fp32 gradient reduction”."""
    values = _run(lambda r, w: _fsdp_grads(r, w, True, True))
    assert max(v["diff"] for v in values) < 2e-2


def test_zero_redundancy_optimizer_all_reduces_then_broadcasts_whole_parameters():
    """06 "§5": “`ZeroRedundancyOptimizer` under DDP sends 3Ψ (DDP's all-reduce, then a broadcast
    per parameter)”. Also 06 "§5": “It assigns whole parameters to ranks, not slices”."""
    runs = _run(lambda r, w: lk.sharding.run_setups(r, w, ("ZeroRedundancyOptimizer",)))
    row = runs[0][0]
    assert row["kinds"] == ["all_reduce", "broadcast"]
    assert row["traffic"]["broadcast"]["calls"] == 6                  # one per parameter tensor
    assert row["volume"] == 3 * 4 * row["psi"]
    state = [r[0]["memory"]["optimizer"] for r in runs]
    assert state[0] != state[1] and sum(state) == 8 * row["psi"] + 6 * 4   # whole tensors


# ------------------------------------------------------------------ §7 DTensor
def _placements(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from labkit.sharding import CommCounter
    mesh = init_device_mesh("cpu", (world_size,))
    out = {"chunk": {}, "to_local": [], "full_tensor": {}}
    for rows in (4, 5):
        d = distribute_tensor(torch.arange(rows * 2.0).view(rows, 2), mesh, [Shard(0)])
        out["chunk"][rows] = tuple(d.to_local().shape)
    w = torch.arange(12.0).view(4, 3)
    p = DTensor.from_local(torch.full((2, 3), rank + 1.0), mesh, [Partial()])
    for name, d in (("Shard", distribute_tensor(w, mesh, [Shard(0)])),
                    ("Replicate", distribute_tensor(w, mesh, [Replicate()])), ("Partial", p)):
        with CommCounter() as c:
            d.to_local()
        out["to_local"] += c.kinds()
        with CommCounter() as c:
            full = d.full_tensor()
        out["full_tensor"][name] = (c.kinds(), full.tolist())
    with CommCounter() as c:
        mine = p.redistribute(mesh, [Shard(0)]).to_local()
    out["partial_to_shard"] = (c.kinds(), tuple(mine.shape), mine.tolist())
    try:
        distribute_tensor(w, mesh, [Shard(0)]).redistribute(mesh, [Partial()])
        out["to_partial"] = None
    except Exception as e:                 # noqa: BLE001 - the message is what is checked
        out["to_partial"] = str(e)
    out["partial_repr"] = repr(Partial())
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_dtensor_placements_chunk_sum_and_communicate_as_the_lab_says(world_size):
    """06 "§7": “cut along tensor dimension d, as `torch.chunk` cuts it: pieces of ⌈size/N⌉, the
    last rank(s) getting what is left, possibly nothing”. Also 06 "§7": “every rank holds a tensor
    of the full shape and the value is their sum (the default reduction, shown as
    `Partial(sum)`)”. Also 06 "§7": “`t.to_local()` returns it, with no communication”. Also 06
    "§7": “it redistributes to `Replicate()`, an all-gather from `Shard` and an all-reduce from
    `Partial`”. Also 06 "§7": “from `Partial()` to `Shard(d)` by a reduce-scatter”. Also 06 "§7":
    “moves to any `Shard` or `Replicate` placement (not to
`Partial`: "redistributing to Partial is for internal use only")”. Also 06 "§7": “leaves each
    rank one row of the *sum*”."""
    values = _run(_placements, world_size)
    n = world_size
    for rows in (4, 5):
        want = [len(c) for c in torch.arange(rows).chunk(n)]
        want += [0] * (n - len(want))                      # torch.chunk can return fewer pieces
        assert [v["chunk"][rows][0] for v in values] == want
    if n == 3:
        assert [v["chunk"][4][0] for v in values] == [2, 2, 0]      # the last rank gets nothing
    total = sum(range(1, n + 1))
    for v in values:
        assert v["to_local"] == []
        assert v["full_tensor"]["Shard"] == (["all_gather"], torch.arange(12.0).view(4, 3).tolist())
        assert v["full_tensor"]["Replicate"][0] == []
        assert v["full_tensor"]["Partial"] == (["all_reduce"], [[float(total)] * 3] * 2)
        assert v["partial_to_shard"][0] == ["reduce_scatter"]
        assert "redistributing to Partial is for internal use only" in v["to_partial"]
    if n == 2:                                             # rank r: row r of the sum, 1 + 2
        assert [v["partial_to_shard"][1:] for v in values] == [((1, 3), [[3.0] * 3])] * 2
        assert v["partial_repr"] == "Partial(sum)"


def _strided(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for rows, cols in ((8, 4), (64, 16)):
        model = torch.nn.Sequential(torch.nn.Linear(cols, rows))
        with torch.no_grad():                       # row i holds i * cols ... (i + 1) * cols - 1
            model[0].weight.copy_(torch.arange(rows * cols, dtype=torch.float32).view(rows, cols))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
        fully_shard(model[0], mesh=mesh["dp"])
        weight = model[0].weight
        local = weight.to_local()
        out[rows] = {"rows": [int(r) // cols for r in local[:, 0].tolist()],
                     "placements": repr(weight.placements)}
    plain = distribute_tensor(torch.arange(8.0).view(8, 1), mesh, [Shard(0), Shard(0)])
    out["plain"] = [int(r) for r in plain.to_local()[:, 0].tolist()]
    return out


def test_fsdp2_over_tensor_parallel_shards_right_to_left_as_strided_shard():
    """06 "§7": “For an 8-row weight on the mesh [[0, 1], [2, 3]] (`dp` × `tp`) that gives rank 0
    rows 0–1, rank 1 rows 4–5, rank 2 rows 2–3 and rank 3 rows 6–7; `[Shard(0), Shard(0)]` would
    mean rows 0–1, 2–3, 4–5, 6–7”. Also 06 "§12": “so rank 1 (dp 0, tp 1) holds rows 32–47, not
    16–31”."""
    values = _run(_strided, 4)
    assert [v[8]["rows"] for v in values] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert [v["plain"] for v in values] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [v[64]["rows"] for v in values] == [list(range(a, a + 16)) for a in (0, 32, 16, 48)]
    assert all(v[rows]["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
               for v in values for rows in (8, 64))


# ------------------------------------------------------------------ §6 the trace
def test_gloo_runs_reduce_scatter_as_an_all_reduce_and_fsdp2_prefetches():
    """06 "§6": “On gloo (torch 2.13) every reduce-scatter (`reduce_scatter_single`, which FSDP2
    calls; `reduce_scatter_tensor` before torch 2.13) runs as a **`gloo:all_reduce`** of the whole
    tensor”. Also 06 "§9": “FSDP2 issues the next layer's all-gather *before* the current layer's
    reduce-scatter: it prefetches it”."""
    def job(rank, world_size):
        import torch.distributed as dist
        from torch.profiler import profile
        out = torch.empty(8)
        with profile() as prof:
            dist.reduce_scatter_single(out, torch.ones(8 * world_size))
        names = [e.name for e in prof.events()]
        return names, lk.sharding.traced_step(rank, world_size, "FSDP2")
    names, spans = _run(job)[0]
    assert "gloo:all_reduce" in names and not any("reduce_scatter" in n for n in names
                                                  if n.startswith("gloo:"))
    order = [(s["kind"], s["label"]) for s in spans if s["lane"] == "comm"]
    backward = order[3:]
    assert backward.index(("all_gather", "L1")) < backward.index(("reduce_scatter", "L2"))


# ------------------------------------------------------------------ §7 tensor parallelism
def _tp_counts(rank, world_size, needs_grad):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from labkit.sharding import CommCounter
    from labkit.sharding.library import cpu_mesh
    from labkit.sharding.model import make_mlp
    from labkit.sharding.tensor_parallel import MegatronMLP
    out = {}
    for name in ("hand", "parallelize_module"):
        mlp = make_mlp((8, 16, 8), seed=0)
        if name == "hand":
            mlp = MegatronMLP(mlp)
        else:
            parallelize_module(mlp, cpu_mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(4, 8, requires_grad=needs_grad)
        with CommCounter() as fwd:
            y = mlp(x)
        with CommCounter() as bwd:
            y.sum().backward()
        out[name] = (fwd.kinds(), len(fwd.calls), len(bwd.calls))
    return out


def test_megatron_mlp_all_reduces_once_forward_and_once_backward_when_the_input_needs_it():
    """06 "§7": “One all-reduce forward, one backward (when the input needs a gradient, as
    inside a network).”"""
    with_grad = _run(lambda r, w: _tp_counts(r, w, True))[0]
    without = _run(lambda r, w: _tp_counts(r, w, False))[0]
    for name in ("hand", "parallelize_module"):
        assert with_grad[name] == (["all_reduce"], 1, 1), with_grad
        assert without[name] == (["all_reduce"], 1, 0), without


def test_parallelize_module_distributes_rank_0s_weights():
    """06 "§7": “`parallelize_module` distributes rank 0's (in torch 2.13 `distribute_tensor` takes
    the data from `src_data_rank=0`)”."""
    values = _run(lk.sharding.tp_library)          # every rank starts from its own seed
    assert max(v["grad_diff"] for v in values) < 1e-6 and max(v["out_diff"] for v in values) < 1e-5


def test_torch_distributed_nn_all_reduce_all_reduces_in_backward_too():
    """06 "§11": “`torch.distributed.nn.functional.all_reduce` all-reduces in backward too, so every
    gradient before it comes out N× too large”."""
    def job(rank, world_size):
        import torch.distributed.nn.functional as dnf
        x = torch.ones(3, requires_grad=True)
        dnf.all_reduce(x * (rank + 1)).sum().backward()
        return x.grad.tolist()
    for n in (2, 4):
        grads = _run(job, n)
        assert grads == [[float(n * (r + 1))] * 3 for r in range(n)]


def test_fsdp2_warns_about_in_place_ops_on_a_view_output():
    """06 "§11": “An in-place op on this view (e.g., `x += y`) will silently drop the
    pre-backward hook and skip the all-gather”."""
    def job(rank, world_size):
        import warnings
        from labkit.sharding.library import TorchFSDP
        setup = TorchFSDP(lk.sharding.model.make_mlp((4, 6, 2)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            setup.module(torch.randn(2, 3, 4))    # [batch, sequence, features]: F.linear
        return [str(w.message) for w in caught]   # returns a view of its 2-D product
    messages = _run(job)[0]
    assert any("will silently drop the pre-backward hook and skip the all-gather" in m
               for m in messages), messages


# ------------------------------------------------------------------ §10 checkpoints
def test_a_sharded_dcp_checkpoint_from_2_ranks_loads_on_4(tmp_path):
    """06 "§10": “a sharded checkpoint with `torch.distributed.checkpoint` (each rank writes its
    own shards; loading reshards to any world size)”."""
    def save(rank, world_size, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from labkit.sharding.library import TorchFSDP
        setup = TorchFSDP(lk.sharding.model.make_mlp((4, 6, 2), seed=7))
        dcp.save({"model": get_model_state_dict(setup.module)}, checkpoint_id=path)

    def load(rank, world_size, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             set_model_state_dict)
        from labkit.sharding.library import TorchFSDP
        setup = TorchFSDP(lk.sharding.model.make_mlp((4, 6, 2), seed=99))
        state = {"model": get_model_state_dict(setup.module)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(setup.module, state["model"])
        return setup.full_parameters()
    path = str(tmp_path / "ckpt")
    _run(save, 2, args=(path,))
    want = list(lk.sharding.model.make_mlp((4, 6, 2), seed=7).parameters())
    for n in (1, 4):
        got = _run(load, n, args=(path,))[n - 1]
        assert all(torch.equal(a, b.detach()) for a, b in zip(got, want))


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@needs_gpus(1)
def test_fsdp2_without_a_mesh_moves_to_cuda_on_a_gpu_machine():
    """06 "§5": “with a CUDA build of torch on a machine with a visible GPU, `fully_shard` without
    a mesh builds a CUDA mesh and moves the module there while the default group is gloo”."""
    def job(rank, world_size):
        from torch.distributed.fsdp import fully_shard
        model = lk.sharding.model.make_mlp((4, 6, 2))
        fully_shard(model)                            # no mesh: torch picks its default
        return str(next(model.parameters()).device)
    assert _run(job, 1, backend="gloo")[0].startswith("cuda")


def test_fsdp2_without_a_mesh_stays_on_the_cpu_with_a_cpu_build():
    """06 "§5": “this lab's CPU-only build always makes a CPU mesh”."""
    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("a CUDA/ROCm build: the test above covers it")

    def job(rank, world_size):
        from torch.distributed.fsdp import fully_shard
        model = lk.sharding.model.make_mlp((4, 6, 2))
        fully_shard(model)
        return str(next(model.parameters()).device)
    assert _run(job, 1, backend="gloo") == ["cpu"]


# ------------------------------------------------------------------ the quotes
def test_the_lab_says_what_these_tests_show():
    _claims.check_quotes(sys.modules[__name__])
