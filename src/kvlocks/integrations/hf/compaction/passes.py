"""The passes that give reference queries after the prefix: "repeat the context", self-study.

See :mod:`.capture` for how their queries are recorded. An instruction is plain text (a blank
line, the instruction, a newline) unless ``chat`` asks for the tokenizer's chat template.

The repeat pass of a prefix longer than ``repeat_tokens`` repeats spans of ``repeat_span``
tokens spread evenly over it, ``repeat_tokens`` in all, each run on the prefix alone after
the instruction, at the positions it has in the whole repeat (the instruction right before
it): every repeated token sits at the same distance from its original as in the whole repeat.
That repeat reaches position 2T + L, past a model's positions from T = 4,090 on the bundled model
(8,192): :func:`kvlocks.integrations.hf.compaction.capture.capture_queries` runs such spans at the last positions
that fit instead (still after the prefix, closer to their originals).
The pass keeps at most ``max_queries`` query rows anyway (1,365 tokens of the bundled model's
G = 3 at the default 4,096), so a whole repeat computes a forward pass over T tokens and keeps
a random third of its rows at T = 4K, a sixth at 8K: measured whole, it is the capture's
largest part (52 s of 93 s at T = 4,096 on one CPU thread); in spans the held-out output
error stays the same (docs/compaction.md, "Speed").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

SELF_STUDY_PROMPTS = (
    "Summarise the text above.",
    "List the facts stated in the text above.",
    "Write three questions that the text above answers.",
)
REPEAT_INSTRUCTION = "Repeat the text above, word for word."


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """Which passes give reference queries (the cap and seed live in ``CompactionConfig``).

    Parameters
    ----------
    repeat : bool
        Add the "repeat the context" pass. Default True.
    self_study : tuple of str
        Self-study prompts; empty for none.
    self_study_tokens : int
        Greedy answer tokens decoded after each self-study prompt (their queries count); >= 0.
    chat : bool
        The prefix is a chat user turn: wrap instructions in the tokenizer's chat template as the
        next user turn (:func:`kvlocks.chat.next_user_turn`) plus the generation prompt, instead
        of plain text.
    repeat_tokens : int
        A prefix of at most this many tokens is repeated whole; a longer one in spans
        (module docstring), this many tokens in all. >= 1.
    repeat_span : int
        Tokens per repeated span. >= 1.
    questions : tuple of str
        Questions the compacted prefix will be asked (user-supplied reference queries), each
        fed as ``kvlocks generate --cache`` feeds a prompt (a user turn of the chat template with
        the generation prompt, where the tokenizer has one: the next turn after a ``chat`` prefix;
        the text as it is for a base model) and followed by ``self_study_tokens`` greedy tokens:
        the queries of the answer read the prefix as the real answer will.
    answer_prefix : str
        Text after each question, as ``kvlocks generate --answer-prefix`` appends it (only with
        ``questions``). A base model given a bare question continues it its own way (Gemma 3 270M
        with a new line and other text, its answer's queries then reading other keys); with the
        prefix the recorded queries are those of the answer itself.
    """

    repeat: bool = True
    self_study: tuple[str, ...] = SELF_STUDY_PROMPTS
    self_study_tokens: int = 32
    chat: bool = False
    repeat_tokens: int = 1536
    repeat_span: int = 256
    questions: tuple[str, ...] = ()
    answer_prefix: str = ""

    def __post_init__(self) -> None:
        qs = self.questions
        if not isinstance(qs, tuple) or not all(isinstance(x, str) and x.strip() for x in qs):
            raise ValueError(f"ReferenceConfig.questions={qs!r}: must be a tuple of non-empty strings")
        if not isinstance(self.answer_prefix, str):
            raise ValueError(f"ReferenceConfig.answer_prefix={self.answer_prefix!r}: must be a string")
        if self.answer_prefix and not qs:
            raise ValueError("ReferenceConfig.answer_prefix follows each question: give questions with it "
                             "(kvlocks compact --question TEXT --answer-prefix TEXT)")
        for name in ("repeat_tokens", "repeat_span"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"ReferenceConfig.{name}={n!r}: must be an integer >= 1")
        if not isinstance(self.repeat, bool):
            raise ValueError(f"ReferenceConfig.repeat={self.repeat!r}: must be a bool")
        if not isinstance(self.chat, bool):
            raise ValueError(f"ReferenceConfig.chat={self.chat!r}: must be a bool")
        prompts = self.self_study
        if not isinstance(prompts, tuple) or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ValueError(f"ReferenceConfig.self_study={prompts!r}: must be a tuple of non-empty strings")
        n = self.self_study_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"ReferenceConfig.self_study_tokens={n!r}: must be an integer >= 0")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class QueryPass:
    """Tokens fed after the prefix whose queries are recorded.

    Attributes
    ----------
    name : str
    ids : Tensor [1, L], int64
    generate : int
        Greedy tokens decoded after ``ids`` (their queries are recorded too).
    segments : tuple of (int, int)
        ``(tokens, first_position)`` of consecutive pieces of ``ids``, each run on the prefix
        alone at positions ``first_position ..``; empty: ``ids`` is one piece continuing the
        prefix (positions T ..). Only a one-piece pass may ``generate``.
    """

    name: str
    ids: torch.Tensor
    generate: int = 0
    segments: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.segments and (sum(n for n, _ in self.segments) != self.ids.shape[1] or self.generate):
            raise ValueError(f"QueryPass {self.name!r}: segments {self.segments} must cover the "
                             f"{self.ids.shape[1]} ids and the pass must not generate")


def _instruction_ids(tokenizer, text: str, chat: bool, *, after_chat: bool = True, suffix: str = "") -> torch.Tensor:
    """``text`` as fed after the prefix: with ``chat``, a user turn of the tokenizer's chat template
    with the generation prompt (the second turn after a chat prefix when ``after_chat``, as
    ``kvlocks generate --cache`` renders it; else a conversation of its own); plain text otherwise.
    ``suffix`` follows the rendered text (an answer prefix)."""
    if chat and getattr(tokenizer, "chat_template", None):
        from kvlocks.chat import next_user_turn

        if after_chat:
            text = next_user_turn(tokenizer, text)
        else:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
    else:
        text = f"\n\n{text}\n"
    return tokenizer(text + suffix, return_tensors="pt", add_special_tokens=False).input_ids  # [1, L]


def reference_passes(tokenizer, prefix_ids: torch.Tensor, config: ReferenceConfig
                     ) -> list[QueryPass]:
    """The repeat and self-study passes of ``config`` for a prefix ``prefix_ids`` [1, T]."""
    passes = []
    if config.repeat:
        head = _instruction_ids(tokenizer, REPEAT_INSTRUCTION, config.chat)
        passes.append(repeat_pass(head, prefix_ids.cpu(), config.repeat_tokens, config.repeat_span))
    for i, prompt in enumerate(config.self_study):
        ids = _instruction_ids(tokenizer, prompt, config.chat)
        passes.append(QueryPass(f"self_study_{i}", ids, generate=config.self_study_tokens))
    for i, question in enumerate(config.questions):
        if getattr(tokenizer, "chat_template", None):
            ids = _instruction_ids(tokenizer, question, True, after_chat=config.chat, suffix=config.answer_prefix)
        else:  # a base model: the text exactly as `kvlocks generate --cache --prompt` feeds it
            ids = tokenizer(question + config.answer_prefix, return_tensors="pt", add_special_tokens=False).input_ids
        passes.append(QueryPass(f"question_{i}", ids, generate=config.self_study_tokens))
    return passes


def repeat_spans(num: int, tokens: int, span: int) -> list[int]:
    """Start positions of the repeated spans of a ``num``-token prefix (module docstring):
    ``ceil(tokens / span)`` spans, the first at 0 and the last ending at ``num``; ``[0]`` with
    the span the whole prefix when ``num <= tokens``."""
    if num <= tokens:
        return [0]
    count = -(-tokens // span)
    if count == 1:
        return [(num - span) // 2]
    return [round(i * (num - span) / (count - 1)) for i in range(count)]


def repeat_pass(head: torch.Tensor, prefix_ids: torch.Tensor, tokens: int, span: int) -> QueryPass:
    """The repeat pass: instruction ``head`` [1, L] then the prefix [1, T], whole or in spans."""
    num = prefix_ids.shape[1]
    if num <= tokens:
        return QueryPass("repeat", torch.cat([head, prefix_ids], dim=1))
    span = min(span, num)
    pieces, segments = [], []
    for a in repeat_spans(num, tokens, span):
        pieces += [head, prefix_ids[:, a:a + span]]
        segments.append((head.shape[1] + span, num + a))  # the instruction right before the span
    return QueryPass("repeat", torch.cat(pieces, dim=1), segments=tuple(segments))
