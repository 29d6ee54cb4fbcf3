"""Quizzes, exercises and grading: one scoring engine for the notebook and the grader.

* :mod:`~labkit.grading.bank` — question banks (``quizzes/NN_name.toml``);
* :mod:`~labkit.grading.score` / :mod:`~labkit.grading.scoring` — what an answer scored, and
  the one engine that scores it (answers here, exercises through their checkers);
* :mod:`~labkit.grading.exercise` — code exercises: :class:`Case`, :func:`case`, checkers;
* :mod:`~labkit.grading.quiz` / :mod:`~labkit.grading.forms` / :mod:`~labkit.grading.context`
  — the notebook side: ``lk.quiz.check/ask/show``, the quiz form, the learner's namespace;
* :mod:`~labkit.grading.kernel` / :mod:`~labkit.grading.grader` — ``python -m labkit grade``:
  each submission in a fresh kernel, scored with the bank's own key;
* :mod:`~labkit.grading.students` — ``python -m labkit students``: student notebooks from
  ``solutions/``;
* :mod:`~labkit.grading.pytest_plugin` — nbval runs grade each lesson notebook in its kernel,
  and leave each solved notebook's executed copy in ``build/executed/``;
* :mod:`~labkit.grading.site` — ``python -m labkit site``: those copies and the cheat sheet as a
  static site.

The submodules load on demand (``lk.quiz``, ``lk.exercise``); this package imports nothing.
"""
