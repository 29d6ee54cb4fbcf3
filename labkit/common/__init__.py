"""Shared pieces below the lessons: rank helpers, models, timelines and pictures.

* :mod:`~labkit.common.ranks` — ``device()``, ``checksum()`` (called inside ranks);
* :mod:`~labkit.common.models` — the small models lessons train;
* :mod:`~labkit.common.timeline` — spans measured inside ranks, on one time axis;
* :mod:`~labkit.common.plots` — every picture of the lab (``lk.plots``);
* :mod:`~labkit.common.progress` — progress bars for anything longer than a few seconds;
* :mod:`~labkit.common.tables` — every measured table, printed from one list of columns;
* :mod:`~labkit.common.checkpoints` — keep the last K checkpoints, prove each whole, fall back
  (notebook 05's script and notebook 08's capstone);
* :mod:`~labkit.common.elastic` — their ``@record``: torch's, with the error file written whole;
* :mod:`~labkit.common.projects` — ``python -m labkit export``: those two projects as folders of
  their own.

No lesson is imported from here: lessons import these, never the other way round.
"""
