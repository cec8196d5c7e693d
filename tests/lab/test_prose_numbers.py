"""The prose_numbers task: one asked four-digit fact among look-alikes, fitted to a length."""

from __future__ import annotations

import random
import re

import pytest

from kvlocks_lab.eval.tasks import TASKS, score
from kvlocks_lab.eval.tasks.prose_numbers import prose_numbers


def test_draft_plants_one_answer_among_distinct_look_alikes():
    for seed in range(20):
        d = prose_numbers(random.Random(seed), 0.5, distractors=5)
        text, _ = d.body(400)
        facts = [f for f in re.findall(r"[^.]*\b\d{4}\b[^.]*\.", text)  # the prose has numbers of its own
                 if re.search(r"[A-Z][a-z]+ of [A-Z][a-z]+", f) and re.search(r"locker|crowns|seat|case number", f)]
        nums = [re.search(r"\b\d{4}\b", f).group() for f in facts]
        assert len(facts) == 6 and len(set(nums)) == 6 and d.references[0] in nums
        asked = [f for f in facts if d.references[0] in f][0]
        person = re.search(r"([A-Z][a-z]+ of [A-Z][a-z]+)", asked).group(1)
        assert person in d.question and person in d.answer_prefix
        assert sum(person.split()[0] in f for f in facts) == 1  # first names never repeat
    with pytest.raises(ValueError, match="distractors=0"):
        prose_numbers(random.Random(0), 0.5, distractors=0)


def test_registered_and_scored_as_a_number():
    spec = TASKS["prose_numbers"]
    assert spec.metric == "all" and spec.shape == "number"
    d = prose_numbers(random.Random(3), 0.2)

    class R:  # the scorer reads these fields of a record
        references, metric, shape = d.references, "all", "number"

    assert score(R, f" {d.references[0]} crowns.")["score"] == 1.0
    assert score(R, " 1234.")["score"] == 0.0 or d.references[0] == "1234"
