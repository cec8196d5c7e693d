"""The passes that give reference queries after the prefix: "repeat the context", self-study.

See :mod:`.capture` for how their queries are recorded. An instruction is plain text (a blank
line, the instruction, a newline) unless ``chat`` asks for the tokenizer's chat template.
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
        Wrap instructions in the tokenizer's chat template (a user turn plus the generation
        prompt) instead of plain text.
    """

    repeat: bool = True
    self_study: tuple[str, ...] = SELF_STUDY_PROMPTS
    self_study_tokens: int = 32
    chat: bool = False

    def __post_init__(self) -> None:
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
    """

    name: str
    ids: torch.Tensor
    generate: int = 0


def _instruction_ids(tokenizer, text: str, chat: bool) -> torch.Tensor:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = f"\n\n{text}\n"
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids  # [1, L]


def reference_passes(tokenizer, prefix_ids: torch.Tensor, config: ReferenceConfig
                     ) -> list[QueryPass]:
    """The repeat and self-study passes of ``config`` for a prefix ``prefix_ids`` [1, T]."""
    passes = []
    if config.repeat:
        head = _instruction_ids(tokenizer, REPEAT_INSTRUCTION, config.chat)
        passes.append(QueryPass("repeat", torch.cat([head, prefix_ids.cpu()], dim=1)))
    for i, prompt in enumerate(config.self_study):
        ids = _instruction_ids(tokenizer, prompt, config.chat)
        passes.append(QueryPass(f"self_study_{i}", ids, generate=config.self_study_tokens))
    return passes
