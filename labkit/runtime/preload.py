"""Which jobs need ``torch._dynamo`` in their ranks, and the zygote's preload of it.

``DistributedDataParallel``'s constructor, every ``torch.optim`` step, FSDP2, DTensor, tensor
parallelism, pipelining and ``torch.utils.checkpoint`` import ``torch._dynamo`` in torch 2.13
(tests/runtime/test_preload.py checks DDP, the optimizer, FSDP2, DTensor and checkpointing):
about a second of CPU in a fresh process on the reference machine, and four
ranks importing it at once on two cores take several. So the zygote imports it once, at its
first idle moment, and ranks forked after that have it for free.

A job that arrives before that moment (a script, Run All) would wait for it. :func:`needs_dynamo`
reads the job's code (no pickling, no import) and answers False only when everything it names
looks free of ``torch._dynamo`` — plain tensors, ``torch.distributed``'s collectives and
point-to-point ops, ``torch.nn`` layers, autograd, the standard library. Then the ranks are
forked without waiting for it. Any doubt (a lesson helper, a module of the learner's, a name on
the list below, a dynamic import) answers True. It reads names, so it can be fooled
(``getattr(torch, "optim")``, a script path given to ``runpy``, a layer's hook): then each rank
imports it itself, as a fresh process would — slower, the same result.
A warm pool forked without it is replaced when a later job needs it (:mod:`labkit.runtime.launch`).
"""
from __future__ import annotations

import dis
import functools
import os
import sys
import types

__all__ = ["needs_dynamo", "preload_dynamo", "IDLE_S", "IDLE_AFTER_FORK_S"]

# Modules (and their submodules) whose use imports torch._dynamo.
_MODULES = ("torch.optim", "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.tensor",
            "torch.distributed._tensor", "torch.distributed.device_mesh", "torch.distributed.optim",
            "torch.distributed.pipelining", "torch.distributed._composable",
            "torch.distributed.algorithms", "torch.distributed.checkpoint", "torch.utils.checkpoint",
            "torch._dynamo", "torch.compiler", "torch._inductor", "torch.export", "torch.func",
            "torch.nn.attention")
# Attribute names that reach those modules from ``torch`` (``torch.optim.SGD``, ``m.compile``).
_NAMES = frozenset({"optim", "parallel", "DistributedDataParallel", "fsdp", "fully_shard",
                    "FullyShardedDataParallel", "distribute_tensor", "distribute_module", "DTensor",
                    "device_mesh", "init_device_mesh", "DeviceMesh", "pipelining", "checkpoint",
                    "compile", "_dynamo", "compiler", "parallelize_module", "export", "func",
                    "ZeroRedundancyOptimizer", "vmap", "jit", "attention", "flex_attention",
                    "import_module", "__import__", "exec", "eval", "run_path", "run_module"})
_PLAIN_ARGS = (type(None), bool, int, float, complex, str, bytes, range, slice)

# The zygote preloads after this long without a message: before its first fork (the kernel may
# still be importing), and after forking ranks without it (their job runs first; a script that
# ran one job has exited by then). LABKIT_PRELOAD_IDLE_S sets both (the tests make it long).
IDLE_S = float(os.environ.get("LABKIT_PRELOAD_IDLE_S", "0.25"))
IDLE_AFTER_FORK_S = float(os.environ.get("LABKIT_PRELOAD_IDLE_S", "2.0"))


def preload_dynamo() -> None:
    import torch._dynamo  # noqa: F401


def needs_dynamo(fn, args: tuple = (), kwargs: dict | None = None) -> bool:
    """False only when nothing the job names is known or suspected to import ``torch._dynamo``."""
    seen: set[int] = set()
    try:
        return any(_needs(x, seen, 0) for x in (fn, *args, *(kwargs or {}).values()))
    except Exception:  # noqa: BLE001 - an object that resists inspection: assume it does
        return True


def _module_needs(name: str) -> bool:
    if not name:
        return True
    top = name.split(".")[0]
    if top == "torch":
        return any(name == m or name.startswith(m + ".") for m in _MODULES)
    return top not in sys.stdlib_module_names and top not in ("__main__", "math", "numpy")


def _needs(obj, seen: set[int], depth: int) -> bool:
    if isinstance(obj, _PLAIN_ARGS) or id(obj) in seen:
        return False
    if depth > 8:
        return True
    seen.add(id(obj))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(_needs(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return any(_needs(x, seen, depth + 1) for x in (*obj.keys(), *obj.values()))
    if isinstance(obj, types.ModuleType):
        return _module_needs(obj.__name__)
    if isinstance(obj, functools.partial):
        return any(_needs(x, seen, depth + 1)
                   for x in (obj.func, *obj.args, *obj.keywords.values()))
    if isinstance(obj, types.MethodType):
        return _needs(obj.__func__, seen, depth + 1) or _needs(obj.__self__, seen, depth + 1)
    if isinstance(obj, types.FunctionType):
        if obj.__module__ != "__main__":          # shipped by reference: its module decides
            return _module_needs(obj.__module__ or "")
        if _code_needs(obj.__code__):
            return True
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        named = [obj.__globals__[n] for n in _names(obj.__code__) if n in obj.__globals__]
        return any(_needs(x, seen, depth + 1)
                   for x in (*cells, *named, *(obj.__defaults__ or ()),
                             *(obj.__kwdefaults__ or {}).values()))
    module = getattr(type(obj), "__module__", "") or ""
    if (module == "torch" and type(obj).__name__ in ("Tensor", "dtype", "device", "Size")) or \
            module in ("torch.nn.parameter", "numpy"):
        return False
    if isinstance(obj, type):                    # a class the job names: where it comes from
        module = obj.__module__ or ""
        if module != "__main__":
            return _module_needs(module)
        return any(_needs(v, seen, depth + 1) for v in (*obj.__bases__, *vars(obj).values())
                   if isinstance(v, (type, types.FunctionType, staticmethod, classmethod,
                                     property)))
    if isinstance(obj, (staticmethod, classmethod)):
        return _needs(obj.__func__, seen, depth + 1)
    if isinstance(obj, property):
        return any(_needs(f, seen, depth + 1) for f in (obj.fget, obj.fset, obj.fdel) if f)
    if module.startswith("torch.nn.modules"):    # a model shipped as an argument: its layers
        return any(not type(m).__module__.startswith("torch.nn.modules") for m in obj.modules())
    return True                                  # anything else: assume it does


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


@functools.lru_cache(maxsize=512)      # a cell's function is run again and again
def _code_needs(code: types.CodeType) -> bool:
    """An import of, or an attribute named like, something on the lists."""
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME" and _module_needs(ins.argval):
            return True
    if _names(code) & _NAMES:
        return True
    return any(_code_needs(c) for c in code.co_consts if isinstance(c, types.CodeType))
