"""Needle-in-a-haystack drafts: passkey, single needle, multi-key, multi-value, multi-query.

A needle binds a key phrase (adjective-noun) to a seven-digit number. The question names one
or more keys; the references are their numbers. The asked needle sits at the record's depth;
the other needles (more values of the same key, other asked keys, distractor keys) sit at
uniformly drawn depths.
"""

from __future__ import annotations

import random

from kvlocks.corpus import natural_slice, natural_units, noise_units
from kvlocks_lab.eval.tasks.build import weave
from kvlocks_lab.eval.tasks.record import Draft
from kvlocks_lab.eval.tasks.words import distinct, key_phrase, number

HAYSTACKS = ("noise", "natural")

NIAH_PREAMBLE = ("The text below hides one or more special magic numbers among ordinary sentences. "
                 "Keep them in mind: a question about them follows the text.")


def filler(haystack: str, rng: random.Random):
    """``units(n)`` for a haystack kind, starting at an offset drawn from ``rng``."""
    if haystack == "noise":
        start = rng.randrange(1000)
        return lambda n: noise_units(n, start)
    if haystack == "natural":
        start = rng.randrange(len(natural_units()))
        return lambda n: natural_slice(n, start)
    raise ValueError(f"haystack={haystack!r}: allowed {HAYSTACKS}")


def needle_body(units, needles):
    """``body(n)``: ``units(n)`` filler with ``needles`` ([(depth, text)]) woven in."""

    def body(n: int):
        pieces, depths = weave(units(n), needles)
        return "".join(pieces), depths

    return body


def passkey(rng: random.Random, depth: float) -> Draft:
    """A five-digit pass key, stated twice in one needle, inside the noise haystack."""
    key = number(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return Draft(
        preamble=("A pass key is hidden somewhere in the long text below. Find it and remember "
                  "it, because you will be asked for it afterwards."),
        body=needle_body(filler("noise", rng), [(depth, needle)]),
        question="What is the pass key? Reply with the number only.",
        answer_prefix="The pass key is",
        references=(key,),
    )


def niah(rng: random.Random, depth: float, *, haystack: str, queries: int = 1, values: int = 1,
         distractors: int = 0) -> Draft:
    """Needles ``"The special magic number for KEY is VALUE."`` in a haystack.

    Parameters
    ----------
    haystack : {"noise", "natural"}
        Repeated filler sentences, or stdlib reference prose.
    queries : int
        Keys asked about (multi-query when > 1).
    values : int
        Numbers bound to each asked key (multi-value when > 1); all must be reported.
    distractors : int
        Further keys with their own numbers, not asked about (multi-key).
    """
    if min(queries, values) < 1 or distractors < 0:
        raise ValueError(f"queries={queries}, values={values}, distractors={distractors}: "
                         "queries and values must be >= 1, distractors >= 0")
    keys = distinct(rng, key_phrase, queries + distractors)
    nums = distinct(rng, number, queries * values + distractors)
    needles, refs = [], []
    for q in range(queries):
        for v in range(values):
            value = nums[q * values + v]
            refs.append(value)
            d = depth if not needles else rng.random()
            needles.append((d, f"The special magic number for {keys[q]} is {value}. "))
    for j in range(distractors):
        needles.append((rng.random(), f"The special magic number for {keys[queries + j]} is "
                                      f"{nums[queries * values + j]}. "))
    asked = keys[:queries]
    if queries == 1:
        names = asked[0]
    else:
        names = ", ".join(asked[:-1]) + " and " + asked[-1]
    plural = queries > 1 or values > 1
    if plural:
        question = (f"What are all the special magic numbers for {names} in the text above? "
                    "List every one of them, numbers only.")
        prefix = f"The special magic numbers for {names} are"
    else:
        question = (f"What is the special magic number for {names} in the text above? "
                    "Reply with the number only.")
        prefix = f"The special magic number for {names} is"
    return Draft(preamble=NIAH_PREAMBLE, body=needle_body(filler(haystack, rng), needles),
                 question=question, answer_prefix=prefix, references=tuple(refs))
