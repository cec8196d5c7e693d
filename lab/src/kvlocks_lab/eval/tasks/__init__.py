"""Offline, seeded RULER-style long-context tasks, fitted to a length by the model's tokenizer.

>>> from kvlocks_lab.eval.tasks import TASKS, generate, score
>>> records = generate("niah_single_text", tokenizer, length=4096, n=8, seed=0)
>>> score(records[0], prediction_text)["score"]

Each :class:`TaskRecord` carries ``context_ids`` (prefilled densely) and ``suffix_ids``
(question + end of user turn + assistant header + answer prefix, decoded token by token).
"""

from kvlocks_lab.eval.tasks.record import Draft, TaskRecord
from kvlocks_lab.eval.tasks.registry import TASKS, generate
from kvlocks_lab.eval.tasks.scoring import (
    SHAPES,
    answer_spans,
    score,
    string_match_all,
    string_match_part,
    string_match_strict,
)
from kvlocks_lab.eval.tasks.spec import TaskSpec

__all__ = [
    "TASKS", "Draft", "SHAPES", "TaskRecord", "TaskSpec", "answer_spans", "generate", "score",
    "string_match_all", "string_match_part", "string_match_strict",
]
