"""``@record`` for the lab's torchrun scripts (notebooks 05 and 08), its error file written whole.

torch's ``@record`` writes a failing worker's traceback to ``$TORCHELASTIC_ERROR_FILE`` with a
plain ``open(file, "w")`` and ``json.dump``. When one worker dies (a SIGKILL, a crash), the
other usually raises too (its peer's connection closed) and starts writing its own file, while
the agent stops the group with SIGTERM. torch 2.13.0's agent then reads every worker's error
file once more (``SubprocessContext._poll``: ``close()``, then ``_capture_process_failures``,
in ``torch/distributed/elastic/multiprocessing/api.py``); a file the SIGTERM cut short is empty,
and ``ProcessFailure`` re-raises the ``JSONDecodeError``: the agent itself crashes instead of
restarting the group (``tests/claims/test_claims_torchrun.py`` reproduces it; seen once in the
capstone grader's SIGKILL run). Here the file is written under a temporary name and renamed into
place, so the agent finds it whole or not at all (then it reports the exit code alone).
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as _torch_record

__all__ = ["record", "AtomicErrorHandler"]

F = TypeVar("F", bound=Callable)


class AtomicErrorHandler(ErrorHandler):
    """torch's ErrorHandler, with the error file renamed into place once written."""

    def record_exception(self, e: BaseException) -> None:
        final = self._get_error_file_path()
        if not final:
            return super().record_exception(e)
        partial = f"{final}.{os.getpid()}.partial"
        self._get_error_file_path = lambda: partial     # torch writes here ...
        try:
            super().record_exception(e)
        finally:
            del self._get_error_file_path
        os.replace(partial, final)                      # ... and only a whole file appears


def record(fn: F) -> F:
    """torch's ``record`` (``torch.distributed.elastic.multiprocessing.errors``), with
    :class:`AtomicErrorHandler`."""
    return _torch_record(fn, error_handler=AtomicErrorHandler())
