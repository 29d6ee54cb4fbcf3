"""Notebook 06 — sharding: ZeRO, FSDP and tensor parallelism on real ranks.

One module per idea, in the order of the notebook:

==================  ===============================================================  =======
module              concept                                                          section
==================  ===============================================================  =======
``model``           the lesson's MLP and batch                                       all
``memory``          bytes a rank holds, read from storages; DDP's memory             §1
``calculator``      the ZeRO formulas; "which to use when" (predictions)             §1, §13
``counting``        ``CommCounter``: every collective a rank issues, counted          §3-§12
``ring``            reduce-scatter and all-gather: notebook 03's ring, in halves     §3
``optim``           Adam and SGD written out (the state ZeRO shards)                 §4, §5
``zero``            ZeRO-1, -2, -3 by hand                                           §4
``library``         DDP, ``ZeroRedundancyOptimizer``, FSDP2 ``fully_shard``            §8
``harness``         one loop that trains, counts, measures every setup               §4, §8
``trace``           one FSDP2 / DDP step on a timeline from ``torch.profiler``        §9
``tensor_parallel`` Megatron's column/row-parallel MLP by hand                        §10
``tp_runs``         TP vs one process, ``parallelize_module``, a 2 × 2 mesh           §10, §12
``pictures``        the notebook's plots                                             all
``check``           the three exercise checkers, their rank jobs and oracles          §5, §6,
                    and the quiz keys computed from the learner's own measurements   §11, §16
``bench``           ``python -m labkit bench sharding``                               —
==================  ===============================================================  =======

In a notebook: ``lk.sharding.run_setups``, ``lk.sharding.ring_all_gather``,
``lk.sharding.calculator.plan_table()`` ...
"""
from . import calculator, counting, harness, memory, model, optim, ring, zero  # noqa: F401
from .calculator import memory_per_rank, plan, plan_table, traffic_per_step
from .counting import CommCounter
from .harness import SETUP_NAMES, run_setups
from .memory import ddp_memory, storage_bytes
from .ring import ring_all_gather, ring_reduce_scatter
from .trace import traced_step
from .tp_runs import mesh_2d, tp_by_hand, tp_library

__all__ = ["CommCounter", "ring_all_gather", "ring_reduce_scatter", "storage_bytes",
           "ddp_memory", "run_setups", "SETUP_NAMES", "traced_step", "tp_by_hand", "tp_library",
           "mesh_2d", "memory_per_rank", "traffic_per_step", "plan", "plan_table"]
