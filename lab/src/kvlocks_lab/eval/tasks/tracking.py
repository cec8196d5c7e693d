"""Variable tracking: one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... in the noise haystack.

With h hops the chain has h + 1 variables; every one of them ends up holding the number, and
all must be reported. The chain's root (the statement with the number) sits at the record's
depth; the h copies follow in order at depths drawn uniformly between it and the end.
"""

from __future__ import annotations

import random

from kvlocks_lab.eval.tasks.needles import filler, needle_body
from kvlocks_lab.eval.tasks.record import Draft
from kvlocks_lab.eval.tasks.words import distinct, number, var_name


def variable_tracking(rng: random.Random, depth: float, *, hops: int) -> Draft:
    """A chain of ``hops`` variable-to-variable assignments after one number assignment."""
    if hops < 1:
        raise ValueError(f"hops={hops}: must be >= 1")
    names = distinct(rng, var_name, hops + 1)
    value = number(rng, 5)
    later = sorted(depth + (1.0 - depth) * rng.random() for _ in range(hops))
    needles = [(depth, f"VAR {names[0]} = {value}. ")]
    needles += [(d, f"VAR {names[i + 1]} = VAR {names[i]}. ") for i, d in enumerate(later)]
    return Draft(
        preamble=("Memorise every variable assignment in the text below; a question about them "
                  "follows the text."),
        body=needle_body(filler("noise", rng), needles),
        question=(f"Which variables are assigned the value {value}, directly or through a chain of "
                  "assignments? List the names of all of them."),
        answer_prefix=f"Answer: the variables assigned the value {value} are:",
        references=tuple(names),
    )
