"""Notebook 07 — scaling and speed: how much faster, what it costs, how to make it cheaper.

* :mod:`~labkit.scaling.timing` — timing done right: alternating paired rounds, slowest rank,
  medians with spread;
* :mod:`~labkit.scaling.task` — the student/teacher task every measurement trains on;
* :mod:`~labkit.scaling.throughput` — samples/s at 1, 2, 4 ranks, strong and weak, and what
  this machine's cores allow (``machine``, ``ceiling``);
* :mod:`~labkit.scaling.predict` — the α–β MODEL PREDICTION for a GPU cluster;
* :mod:`~labkit.scaling.overlap` — the overlap condition (backward vs all-reduce), measured;
* :mod:`~labkit.scaling.hooks` — DDP comm hooks (fp16, PowerSGD), bytes counted by the trace;
* :mod:`~labkit.scaling.precision` — fp32 vs bf16 autocast vs fp16 + GradScaler;
* :mod:`~labkit.scaling.knobs` — gradient_as_bucket_view, static_graph, bucket_cap_mb,
  find_unused_parameters;
* :mod:`~labkit.scaling.costs` — every collective against its α–β formula, busbw conventions;
* :mod:`~labkit.scaling.pipeline` — GPipe, 1F1B, interleaved: bubble and activation memory;
* :mod:`~labkit.scaling.batch_lr` — global batch, linear LR scaling, warm-up, divergence;
* :mod:`~labkit.scaling.check` — the compression-hook checker and the quiz keys;
* :mod:`~labkit.scaling.bench` — ``python -m labkit bench scaling``.

``lk.scaling.X`` reaches the names below. Seeing every collective of a job is
``lk.run(fn, n, trace=True)`` (:mod:`labkit.runtime.commtrace`), drawn by
``lk.plots.comm_timeline``.
"""
from . import task
from .batch_lr import DEFAULT_CONFIGS, lr_runs, lr_table, plot_lr_runs, warmup_lr
from .check import check_compress_hook
from .costs import (BUSBW_FACTOR, COLLECTIVES, busbw_factor, cost_rows, cost_table, fit_link,
                    measure_costs, model_time)
from .hooks import HOOKS, compare_hooks, hook_table, make_hook, plot_hooks, powersgd_bytes
from .knobs import SETTINGS, knob_table, measure_knobs
from .overlap import measure_overlap_condition, overlap_table
from .pipeline import SCHEDULES, bubble_formula, measure_pipeline, memory_formula, pipeline_table
from .precision import compare_precision, precision_table
from .predict import GPU, cluster_prediction, cluster_table
from .throughput import ceiling, machine, measure_scaling, plot_scaling, scaling_table
from .timing import alternating, ratio_summary, slowest, summary

__all__ = ["task", "machine", "ceiling", "measure_scaling", "scaling_table", "plot_scaling",
           "alternating", "slowest",
           "summary", "ratio_summary", "cluster_prediction", "cluster_table", "GPU",
           "measure_overlap_condition", "overlap_table", "HOOKS", "make_hook", "compare_hooks",
           "hook_table", "plot_hooks", "powersgd_bytes", "compare_precision", "precision_table", "SETTINGS",
           "measure_knobs", "knob_table", "COLLECTIVES", "BUSBW_FACTOR", "busbw_factor",
           "model_time", "measure_costs", "fit_link", "cost_rows", "cost_table", "SCHEDULES",
           "bubble_formula", "memory_formula", "measure_pipeline", "pipeline_table",
           "DEFAULT_CONFIGS", "warmup_lr", "lr_runs", "lr_table", "plot_lr_runs",
           "check_compress_hook"]
