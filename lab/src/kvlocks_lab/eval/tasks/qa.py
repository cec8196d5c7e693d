"""Long-document QA: stdlib reference prose with planted facts about invented towns.

Each fact binds an invented town (and sometimes a noun) to a short answer: a month, a number,
a colour, a first name or a material. One fact is asked about and sits at the record's depth;
the others are distractors at uniform depths, possibly of the same kind for another town, so
the model has to bind the answer to the right town. Answers are single words or numbers.
"""

from __future__ import annotations

import random

from kvlocks_lab.eval.tasks.needles import filler, needle_body
from kvlocks_lab.eval.tasks.record import Draft
from kvlocks_lab.eval.tasks.words import COLOURS, FIRST_NAMES, MATERIALS, MONTHS, NOUNS, distinct, town

# (fact, question, answer prefix, answer choices); {town}, {noun} and {answer} are filled in.
# Numbers are all two-digit, so no numeric answer is a substring of another.
FACTS = (
    ("In {town}, the yearly {noun} festival is always held in {answer}.",
     "In which month is the yearly {noun} festival of {town} held?",
     "The yearly {noun} festival of {town} is held in", MONTHS),
    ("The {noun} museum of {town} has exactly {answer} rooms.",
     "How many rooms does the {noun} museum of {town} have?",
     "The {noun} museum of {town} has", tuple(str(k) for k in range(12, 98))),
    ("The lighthouse of {town} is painted {answer}.",
     "What colour is the lighthouse of {town} painted?",
     "The lighthouse of {town} is painted", COLOURS),
    ("The {noun} society of {town} was founded by a baker named {answer}.",
     "What was the name of the baker who founded the {noun} society of {town}?",
     "The {noun} society of {town} was founded by a baker named", FIRST_NAMES),
    ("The morning ferry to {town} leaves from pier number {answer}.",
     "From which pier number does the morning ferry to {town} leave?",
     "The morning ferry to {town} leaves from pier number", tuple(str(k) for k in range(10, 60))),
    ("The clock tower of {town} was built from {answer}.",
     "What material was the clock tower of {town} built from?",
     "The clock tower of {town} was built from", MATERIALS),
)


def document_qa(rng: random.Random, depth: float, *, facts: int = 4) -> Draft:
    """Plant ``facts`` facts (the first one asked) in natural prose."""
    if facts < 1:
        raise ValueError(f"facts={facts}: must be >= 1")
    towns = distinct(rng, town, facts)
    kinds = [rng.randrange(len(FACTS)) for _ in range(facts)]
    needles, answers = [], []
    for i, (name, kind) in enumerate(zip(towns, kinds)):
        fact, question, prefix, choices = FACTS[kind]
        answer = rng.choice(choices)
        while i and answer == answers[0]:  # the asked answer must not appear in a distractor
            answer = rng.choice(choices)
        slots = {"town": name, "noun": rng.choice(NOUNS), "answer": answer}
        if i == 0:
            asked = (question.format(**slots), prefix.format(**slots))
        answers.append(answer)
        needles.append((depth if i == 0 else rng.random(), fact.format(**slots) + " "))
    return Draft(
        preamble=("Read the document below and answer the question that follows it. The answer is "
                  "stated somewhere in the document."),
        body=needle_body(filler("natural", rng), needles),
        question=f"{asked[0]} Answer with one word or number.",
        answer_prefix=asked[1],
        references=(answers[0],),
    )
