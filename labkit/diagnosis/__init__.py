"""Diagnosing a distributed job (notebook 04): which rank, which collective, why, and the fix.

* :mod:`~labkit.diagnosis.diagnose` — :func:`diagnose`: a verdict for a failed (or silently
  wrong) job, following the order production engineers debug in;
* :mod:`~labkit.diagnosis.findings` — one rank's story, read from its traceback or stack dump;
* :mod:`~labkit.diagnosis.replicas` — evidence ranks return: parameter fingerprints, flight
  records, sampler shards; compared across ranks;
* :mod:`~labkit.diagnosis.verdict` — the :class:`Verdict` both produce.

``lk.diagnose(result)`` is :func:`diagnose`; ``lk.diagnosis.X`` reaches the names below.
"""
from .diagnose import diagnose
from .replicas import (Fingerprint, FlightRecord, ShardLog, check_replicas, compare_fingerprints,
                       compare_flight_records, compare_shards, diagnose_values, fingerprint,
                       flight_record)
from .verdict import KINDS, RankFinding, Verdict

__all__ = ["diagnose", "Verdict", "RankFinding", "KINDS", "fingerprint", "Fingerprint",
           "check_replicas", "compare_fingerprints", "flight_record", "FlightRecord",
           "compare_flight_records", "ShardLog", "compare_shards", "diagnose_values"]
