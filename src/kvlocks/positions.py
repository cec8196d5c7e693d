"""The context-length policy: a prompt plus its new tokens must fit the model's positions.

Every entry point that takes a prompt (the CLI, the Hugging Face cache, the engine) calls
:func:`check_context`: beyond ``max_position_embeddings`` a RoPE model decodes positions it was
never trained on and answers worse without any error, so the prompt is refused, or cut only when
the caller names the side to drop (``truncate="left"`` keeps the end of the prompt, ``"right"``
its start).
"""

from __future__ import annotations

TRUNCATE = ("left", "right")


def position_limit(model_config) -> int | None:
    """The model's ``max_position_embeddings`` (of its text config), or None when it has none."""
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    limit = getattr(cfg, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def check_context(prompt_tokens: int, new_tokens: int, limit: int | None, *, truncate: str | None = None,
                  what: str = "prompt") -> slice:
    """The slice of the prompt to keep: all of it when ``prompt_tokens + new_tokens <= limit``.

    Otherwise ``ValueError`` naming both counts and the limit, unless ``truncate`` is ``"left"``
    (drop the prompt's first tokens) or ``"right"`` (drop its last ones); a prompt that cannot
    keep a single token is refused either way. ``limit`` None: no limit.
    """
    if truncate is not None and truncate not in TRUNCATE:
        raise ValueError(f"truncate={truncate!r}: allowed {TRUNCATE} or None")
    if prompt_tokens < 1:
        raise ValueError(f"the {what} is empty: at least one token is needed")
    if limit is None or prompt_tokens + new_tokens <= limit:
        return slice(0, prompt_tokens)
    keep = limit - new_tokens
    if truncate is None or keep < 1:
        how = ("" if keep < 1 else f"; ask to truncate it (keep the end: truncate='left', the start: "
               f"'right') to {keep} tokens")
        raise ValueError(f"the {what} ({prompt_tokens} tokens) plus {new_tokens} new tokens exceeds the model's "
                         f"{limit} positions (max_position_embeddings){how}")
    return slice(prompt_tokens - keep, prompt_tokens) if truncate == "left" else slice(0, keep)
