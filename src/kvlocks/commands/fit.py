"""Fit a ``kvlocks generate`` prompt into the model's positions (``--truncate left|right``).

The policy itself is :func:`kvlocks.positions.check_context`: a prompt plus its new tokens past
``max_position_embeddings`` is refused. With ``--truncate`` the user's own text is cut on the
named side, never the chat template's framing (system header, turn markers) nor the answer prefix:
``left`` drops the start of the text (keeps the question at its end), ``right`` its end.
"""

from __future__ import annotations

from typing import Callable

from kvlocks.positions import check_context


def fit_prompt(tok, text: str, render: Callable[[str], str], new_tokens: int, limit: int | None,
               truncate: str | None, *, offset: int = 0, special: bool = False) -> tuple[str, int]:
    """The rendered prompt that fits, and how many tokens of ``text`` were dropped.

    Parameters
    ----------
    tok : a Hugging Face tokenizer (fast: offsets are used to cut at token boundaries)
    text : the user's text (the prompt, or the last user message)
    render : text -> the full prompt string (chat template, answer prefix)
    new_tokens : tokens to be generated
    limit : the model's positions (None: no limit)
    truncate : None (refuse when over), ``"left"`` or ``"right"``
    offset : positions already taken before the prompt (a compacted prefix's T)
    special : the prompt is tokenized with the tokenizer's special tokens (a BOS) added
    """
    def count(s: str) -> int:
        return len(tok(s, add_special_tokens=special).input_ids)

    avail = None if limit is None else limit - offset
    if avail is not None and avail < 1:
        raise ValueError(f"the compacted prefix ({offset} positions) leaves no room in the model's {limit} positions")
    prompt = render(text)
    n = count(prompt)
    if avail is None or n + new_tokens <= avail:
        return prompt, 0
    if truncate is None:
        room = (f"the {avail} positions left after the compacted prefix's {offset} (of the model's {limit})"
                if offset else f"the model's {limit} positions")
        raise ValueError(f"the prompt ({n} tokens) plus {new_tokens} new tokens exceeds {room}: shorten it, lower "
                         "--max-new-tokens, or pass --truncate left (drop the start of its text) or --truncate "
                         "right (drop its end)")
    check_context(n, new_tokens, avail, truncate=truncate)  # validates `truncate`; refuses when nothing fits
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, total = enc["offset_mapping"], len(enc.input_ids)
    drop = n + new_tokens - avail
    for _ in range(4):  # the re-rendered text may tokenize a few tokens apart at the cut
        if drop >= total:
            raise ValueError(f"the prompt's framing (chat template, answer prefix) plus {new_tokens} new tokens "
                             f"leaves no room for its text in {avail} positions")
        cut = text[spans[drop][0]:] if truncate == "left" else text[: spans[total - drop - 1][1]]
        prompt = render(cut)
        over = count(prompt) + new_tokens - avail
        if over <= 0:
            return prompt, drop
        drop += over
    raise ValueError(f"could not truncate the prompt to {avail} positions")
