"""Chat-template text for a user turn that continues a conversation already in a cache.

A compacted prefix made with ``kvlocks compact --chat`` holds the template's rendering of one user
turn (with the system prompt a template adds to a conversation's start). A question asked after
it must be the template's rendering of a *second* user turn; rendered as a conversation of its own
it would repeat the system prompt in mid-context, which the model reads as a new conversation
(SmolLM2-135M then ignores the document: full attention over the original tokens laid out that
way answers a planted-number question wrongly, and correctly without the second system prompt).
"""

from __future__ import annotations

_FIRST = [{"role": "user", "content": "x"}]


def next_user_turn(tokenizer, text: str, *, add_generation_prompt: bool = True) -> str:
    """The text the tokenizer's chat template adds for user turn ``text`` after a first user turn.

    Computed as the rendering of ``[first turn, this turn]`` less the rendering of ``[first turn]``
    (the first turn's content does not change what follows it). Templates where that rendering is
    not a prefix, or that refuse two user turns in a row, get the turn rendered as a conversation of
    its own (what they would give without a cached turn before it).
    """
    alone = [{"role": "user", "content": text}]
    try:
        first = tokenizer.apply_chat_template(_FIRST, tokenize=False)
        both = tokenizer.apply_chat_template(_FIRST + alone, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception:  # noqa: BLE001 - a template's own error (e.g. roles must alternate)
        first, both = None, None
    if first is not None and both.startswith(first) and len(both) > len(first):
        return both[len(first):]
    return tokenizer.apply_chat_template(alone, tokenize=False, add_generation_prompt=add_generation_prompt)
