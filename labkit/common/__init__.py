"""Shared pieces below the lessons: rank helpers, models, timelines and pictures.

* :mod:`~labkit.common.ranks` — ``device()``, ``checksum()`` (called inside ranks);
* :mod:`~labkit.common.models` — the small models lessons train;
* :mod:`~labkit.common.timeline` — spans measured inside ranks, on one time axis;
* :mod:`~labkit.common.plots` — every picture of the lab (``lk.plots``);
* :mod:`~labkit.common.progress` — progress bars for anything longer than a few seconds;
* :mod:`~labkit.common.tables` — every measured table, printed from one list of columns;
* :mod:`~labkit.common.projects` — ``python -m labkit export``: notebook 05's and 08's projects,
  with the :mod:`labkit.portable` files they need, as folders of their own.

No lesson is imported from here: lessons import these, never the other way round.
"""
