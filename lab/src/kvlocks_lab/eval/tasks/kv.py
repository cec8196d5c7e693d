"""Key-value retrieval: a JSON object of UUID keys and UUID values; report one key's value.

UUIDs come from the record's seeded stream (``uuid.UUID(int=rng.getrandbits(128), version=4)``),
never from ``uuid.uuid4()``. The asked pair sits at the record's depth; a unit is one pair.
"""

from __future__ import annotations

import random
import uuid

from kvlocks_lab.eval.tasks.build import weave
from kvlocks_lab.eval.tasks.record import Draft


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kv_uuid(rng: random.Random, depth: float) -> Draft:
    """Retrieve the value of one key among ``n`` distractor pairs."""
    key, value = _uuid(rng), _uuid(rng)
    pairs_seed = rng.getrandbits(64)
    needle = f'"{key}": "{value}"'

    def body(n: int):
        r = random.Random(pairs_seed)
        pairs = [f'"{_uuid(r)}": "{_uuid(r)}"' for _ in range(n)]
        pieces, depths = weave(pairs, [(depth, needle)])
        return "{" + ", ".join(pieces) + "}", depths

    return Draft(
        preamble="The JSON object below maps keys to values. Every key and every value is a UUID.",
        body=body,
        question=(f'What value does the key "{key}" map to in the JSON object above? '
                  "Reply with the UUID only."),
        answer_prefix=f'The value of the key "{key}" is:',
        references=(value,),
    )
