"""Numbers about people in natural prose, among look-alike distractors of the same form.

Each record plants several facts that bind a person (a first name and an invented town) to a
four-digit number in one of a few sentence forms: a locker, an invoice, a seat, a case file.
One fact is asked about; the distractors use the same forms for other people (every first name
differs), one of them the same form and noun, so the answer page differs from its look-alike only
by the person. This is
the hard case for page selection at tight budgets: several pages carry near-identical key
patterns, and only the name separates the one the question needs.
"""

from __future__ import annotations

import random

from kvlocks_lab.eval.tasks.needles import filler, needle_body
from kvlocks_lab.eval.tasks.record import Draft
from kvlocks_lab.eval.tasks.words import FIRST_NAMES, NOUNS, distinct, number, town

# (fact, question, answer prefix); {person}, {noun} and {answer} are filled in
FORMS = (
    ("{person} keeps the spare key to the {noun} shed in locker {answer}.",
     "In which locker does {person} keep the spare key to the {noun} shed?",
     "{person} keeps the spare key to the {noun} shed in locker"),
    ("The invoice for the {noun} that {person} ordered last winter came to {answer} crowns.",
     "How many crowns did the invoice for the {noun} that {person} ordered come to?",
     "The invoice for the {noun} that {person} ordered came to"),
    ("On the night train to the coast, {person} always books seat {answer} near the {noun}.",
     "Which seat does {person} book on the night train to the coast?",
     "On the night train to the coast, {person} books seat"),
    ("At the {noun} archive, the report by {person} is filed under case number {answer}.",
     "Under which case number is the report by {person} filed at the {noun} archive?",
     "The report by {person} is filed under case number"),
)


def prose_numbers(rng: random.Random, depth: float, *, distractors: int = 5) -> Draft:
    """The asked fact at ``depth`` and ``distractors`` look-alikes at uniform depths.

    At least one distractor shares the asked fact's form and noun (another person); every number
    is distinct and four digits long, so no answer is a substring of another.
    """
    if distractors < 1:
        raise ValueError(f"distractors={distractors}: must be >= 1")
    names = distinct(rng, lambda r: r.choice(FIRST_NAMES), distractors + 1)  # every first name differs
    people = [f"{name} of {town(rng)}" for name in names]
    nums = distinct(rng, lambda r: number(r, 4), distractors + 1)
    kind, noun = rng.randrange(len(FORMS)), rng.choice(NOUNS)
    needles, asked = [], None
    for i, (person, answer) in enumerate(zip(people, nums)):
        k, n = (kind, noun) if i <= 1 else (rng.randrange(len(FORMS)), rng.choice(NOUNS))  # 1: same form
        fact, question, prefix = FORMS[k]
        slots = {"person": person, "noun": n, "answer": answer}
        if i == 0:
            asked = (question.format(**slots), prefix.format(**slots))
        needles.append((depth if i == 0 else rng.random(), fact.format(**slots) + " "))
    return Draft(
        preamble=("Read the document below and answer the question that follows it. The answer is "
                  "a four-digit number stated somewhere in the document."),
        body=needle_body(filler("natural", rng), needles),
        question=f"{asked[0]} Answer with the number only.",
        answer_prefix=asked[1],
        references=(nums[0],),
    )
