"""Exercises that answer back: every exercise of chapters 1-10 checks the learner's own answer or code.

At the top of a chapter's exercise section::

    from llmkit.course import exercises
    ex = exercises.chapter(4)     # the chapter's checks: ex.q1, ex.q2, ...
    ex.progress()                 # a widget: which of them are done (kept across kernel restarts)

and under each exercise an answer cell (tagged ``answer``: the learner replaces its ``...``), then one line (tagged
``check``)::

    ex.q1.check(steps_beside_two, steps_alone)   # ✓, or ✗ and what differs (never the answer), or "not answered yet"
    ex.q1.hint()                                 # the next hint, one at a time
    ex.q1.solution()                             # the hidden solution cell's code, read from the notebook

What a check compares the answer with (``core.KINDS``): a value or prediction, with what the kit measures live on this
machine (the tolerance and its reason in the message); code, called on cases it has not seen, plugged into a real
``Engine`` where it fills a seam, and judged against the real llama-server where it says something about it. A crash in
the learner's code is shown as theirs (their traceback); an answer still ``...`` is "not answered yet", which fails
nothing (the notebooks run from top to bottom with their answer cells empty).

The parts:

    verdict    Verdict: what a check found, and its statuses (pass, fail, not answered, error)
    core       Exercise, Chapter; Wrong and TheirError (what a judge raises); call (the learner's code)
    expect     the kind and value of an answer (whole_number, same, near, ...): messages that never give the answer
    notebook   an exercise's cells in its notebook: hints, solution (the notebook is their only source)
    lab        the model, servers and measurements the checks share, started once
    done       which exercises are done: the per-user file, the widget (``progress()``), ``llmkit exercises``
    classroom  a student edition of the notebooks, and a class's notebooks graded (``llmkit exercises student|grade``)
    cage       the sandbox a graded submission runs in (bubblewrap, or a weaker fallback)
    inside     what runs in the cage: a submission's answers, then each verdict in a fresh process
    answers    an answer cell as data: its values as JSON, the statements that define its code
    context    the names a chapter sets up before its exercises, given to an answer cell run alone
    ch01 ... ch10   each chapter's checks
"""

from __future__ import annotations

from llmkit.course.exercises.core import CHAPTERS, Chapter, Exercise, chapter, chapters, progress
from llmkit.course.exercises.verdict import Verdict

__all__ = ["CHAPTERS", "Chapter", "Exercise", "Verdict", "chapter", "chapters", "progress"]
