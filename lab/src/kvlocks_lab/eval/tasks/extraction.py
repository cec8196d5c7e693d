"""Aggregation tasks: common-words and frequent-words extraction (no needle, no depth).

- Common words (``cwe``): a numbered list of real words in which ``top`` words appear once per
  round and every other word appears about ``3n / 295`` times in n rounds; report the ``top``
  common words.
- Frequent words (``fwe``): a text of invented five-letter words whose counts follow a Zipf
  law, count(rank r) proportional to r^-alpha; report the ``top`` most frequent words. Counts
  are allotted exactly (largest remainder), then shuffled, so the answer is never a tie.
"""

from __future__ import annotations

import random

from kvlocks_lab.eval.tasks.record import Draft
from kvlocks_lab.eval.tasks.words import ADJECTIVES, NOUNS, distinct, pseudo_word

RARE_PER_ROUND = 3


def common_words(rng: random.Random, depth: float, *, top: int = 5) -> Draft:
    """Numbered word list dominated by ``top`` words (a unit is one round of ``top + 3`` items)."""
    pool = list(NOUNS + ADJECTIVES)
    rng.shuffle(pool)
    common, rare = pool[:top], pool[top:]
    shuffle_seed = rng.getrandbits(64)

    def body(n: int):
        items = []
        for j in range(n):
            items += common
            items += [rare[(RARE_PER_ROUND * j + t) % len(rare)] for t in range(RARE_PER_ROUND)]
        random.Random(shuffle_seed).shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), ()

    return Draft(
        preamble="Below is a numbered list of words. A few words occur far more often than the rest.",
        body=body,
        question=f"Which {top} words occur most often in the list above? Reply with the {top} words only.",
        answer_prefix=f"Answer: the {top} most frequent words in the list are:",
        references=tuple(common),
        min_units=3,  # common words then occur >= 3 times, rare words once
    )


def zipf_counts(total: int, vocab: int, alpha: float) -> list[int]:
    """Split ``total`` words over ``vocab`` ranks in proportion to ``r ** -alpha``.

    Largest-remainder rounding: the counts sum to ``total`` exactly and are non-increasing.
    """
    weights = [r ** -alpha for r in range(1, vocab + 1)]
    z = sum(weights)
    exact = [total * w / z for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(vocab), key=lambda r: (counts[r] - exact[r], r))
    for r in by_remainder[: total - sum(counts)]:
        counts[r] += 1
    return counts


def frequent_words(rng: random.Random, depth: float, *, top: int = 3, alpha: float = 2.0,
                   vocab: int = 64) -> Draft:
    """Coded text of invented words with Zipf counts (a unit is one word)."""
    words = distinct(rng, pseudo_word, vocab)
    shuffle_seed = rng.getrandbits(64)

    def body(n: int):
        counts = zipf_counts(n, vocab, alpha)
        if counts[top - 1] <= counts[top]:
            raise ValueError(f"{n} words are too few to separate the top {top} (counts {counts[:top + 1]})")
        items = [w for w, c in zip(words, counts) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(items)
        return " ".join(items), ()

    return Draft(
        preamble=("Below is a coded text made of invented words. Keep track of how often each "
                  "word occurs."),
        body=body,
        question=(f"Which {top} coded words occur most often in the text above? "
                  f"Reply with the {top} words only."),
        answer_prefix=f"Answer: the {top} most frequent coded words in the text are:",
        references=tuple(words[:top]),
        min_units=80,  # at alpha=2 the 3rd and 4th counts then differ by >= 2
    )
