"""The task registry: ``TASKS`` (name -> :class:`TaskSpec`) and :func:`generate`.

Generation budgets are sized for the answers (a seven-digit number is 7 tokens in SmolLM2's
tokenizer, a UUID about 30) with room for a short lead-in, and are kept small because every
generated token is a decode step of every method in the grid.
"""

from __future__ import annotations

from functools import partial

from kvlocks_lab.eval.tasks.extraction import common_words, frequent_words
from kvlocks_lab.eval.tasks.kv import kv_uuid
from kvlocks_lab.eval.tasks.needles import niah, passkey
from kvlocks_lab.eval.tasks.prose_numbers import prose_numbers
from kvlocks_lab.eval.tasks.qa import document_qa
from kvlocks_lab.eval.tasks.record import TaskRecord
from kvlocks_lab.eval.tasks.spec import TaskSpec
from kvlocks_lab.eval.tasks.tracking import variable_tracking

_SPECS = (
    TaskSpec(name="passkey", draft=passkey, metric="all", shape="number", max_new_tokens=16,
             description="five-digit pass key in repeated filler"),
    TaskSpec(name="niah_single_noise", draft=partial(niah, haystack="noise"), metric="all",
             shape="number", max_new_tokens=16, description="one needle in repeated filler"),
    TaskSpec(name="niah_single_text", draft=partial(niah, haystack="natural"), metric="all",
             shape="number", max_new_tokens=16, description="one needle in natural prose"),
    TaskSpec(name="niah_multikey", draft=partial(niah, haystack="natural", distractors=3),
             metric="all", shape="number", max_new_tokens=16,
             description="one asked needle among 3 distractor keys, natural prose"),
    TaskSpec(name="niah_multivalue", draft=partial(niah, haystack="natural", values=4),
             metric="all", shape="number", max_new_tokens=48,
             description="one key with 4 numbers, all to be reported"),
    TaskSpec(name="niah_multiquery", draft=partial(niah, haystack="natural", queries=4),
             metric="all", shape="number", max_new_tokens=48,
             description="4 keys asked at once"),
    TaskSpec(name="vt_2hop", draft=partial(variable_tracking, hops=2), metric="all",
             shape="varname", max_new_tokens=32, description="variable chain with 2 hops"),
    TaskSpec(name="vt_4hop", draft=partial(variable_tracking, hops=4), metric="all",
             shape="varname", max_new_tokens=32, description="variable chain with 4 hops"),
    TaskSpec(name="cwe", draft=common_words, metric="all", shape="word", max_new_tokens=32,
             description="5 most common words of a numbered list"),
    TaskSpec(name="fwe", draft=frequent_words, metric="all", shape="word", max_new_tokens=32,
             description="3 most frequent invented words (Zipf counts)"),
    TaskSpec(name="kv_uuid", draft=kv_uuid, metric="all", shape="uuid", max_new_tokens=48,
             description="value of one UUID key in a JSON object"),
    TaskSpec(name="qa_doc", draft=document_qa, metric="part", shape="token", max_new_tokens=16,
             description="short-answer question on a planted fact among 3 distractor facts"),
    TaskSpec(name="prose_numbers", draft=prose_numbers, metric="all", shape="number", max_new_tokens=16,
             description="a four-digit number about one person among 5 look-alike facts about others"),
)

TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in _SPECS}


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0) -> list[TaskRecord]:
    """Records ``0 .. n-1`` of ``task`` at target length ``length`` tokens.

    Parameters
    ----------
    task : str
        A key of :data:`TASKS`.
    tokenizer : transformers tokenizer
        The model's own tokenizer (without a chat template: plain-text prompts); lengths are counted with it.
    length : int
        Target length L: prompt tokens plus ``max_new_tokens`` never exceed it.
    n : int
        Number of records (>= 0).
    seed : int
        Records are a pure function of ``(task, seed, index)`` and the length.

    Returns
    -------
    list of TaskRecord
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r}: allowed {tuple(TASKS)}")
    for name, value, low in (("length", length, 64), ("n", n, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r}: must be an integer")
    return TASKS[task](tokenizer, length, n, seed)
