"""Your own records for ``kvlocks eval --records FILE.jsonl``: the schema, its checks, the scorers.

One JSON object per line (blank lines are skipped). Fields:

- the prompt, exactly one of ``messages`` (a list of ``{"role", "content"}`` with roles
  ``system``, ``user``, ``assistant``, ending with a ``user`` message; rendered with the
  model's chat template and its assistant header) or ``text`` (used as it is, no template);
- ``question`` (optional): a string of the last message (or of ``text``) where decoding starts:
  everything before its last occurrence is the document, prefilled densely once; from it on,
  the question, the end of the turn, the assistant header and the answer prefix are decoded
  one token at a time, with each method selecting. Without it, only what follows the last
  message (end of turn, assistant header, answer prefix) is decoded;
- ``answer_prefix`` (optional, default ``""``): text the answer starts with, decoded;
- ``answers``: a non-empty list of expected answers (strings);
- ``scorer`` (optional, default ``"contains"``): a name of :data:`SCORERS` (``exact``,
  ``contains``, ``contains_all``, ``number``) or of the ``scorers`` passed to
  :func:`kvlocks_lab.eval.records_run.run_records` (your own Python callables);
- ``max_new_tokens`` (optional, default 32, 1 to 4096): tokens generated per method;
- ``id`` (optional string or integer, unique), ``task`` (optional group name, default the
  file's stem), ``length`` (optional integer label the tables group by, default the smallest
  power of two >= prompt tokens + ``max_new_tokens``), ``meta`` (optional object, copied into
  every row).

Any other field is an error, as is a wrong type: the message names the record (its number and
line) and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvlocks_lab.eval.tasks.build import plain_bos

FIELDS = ("messages", "text", "question", "answer_prefix", "answers", "scorer", "max_new_tokens", "id", "task",
          "length", "meta")
ROLES = ("system", "user", "assistant")
MAX_NEW_TOKENS = 4096
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_PUNCT = " \t\n\r.,;:!?\"'`()[]{}"


def _norm(text: str) -> str:
    return " ".join(text.strip(_PUNCT).lower().split())


def exact(prediction: str, answers: list[str]) -> float:
    """1 if the prediction's first line equals an answer (case, spaces and surrounding
    punctuation ignored), else 0."""
    first = prediction.strip().split("\n", 1)[0] if prediction.strip() else ""
    return float(_norm(first) in {_norm(a) for a in answers})


def contains(prediction: str, answers: list[str]) -> float:
    """1 if any answer occurs in the prediction (case ignored), else 0."""
    text = prediction.lower()
    return float(any(a.lower() in text for a in answers))


def contains_all(prediction: str, answers: list[str]) -> float:
    """Fraction of the answers that occur in the prediction (case ignored)."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def number(prediction: str, answers: list[str]) -> float:
    """1 if the first number in the prediction equals an answer numerically ("1,024" = "1024.0")."""
    found = _NUMBER.search(prediction)
    value = None if found is None else _to_number(found.group())
    return float(value is not None and any(_to_number(a) == value for a in answers))


SCORERS: dict[str, Callable[[str, list[str]], float]] = {
    "exact": exact, "contains": contains, "contains_all": contains_all, "number": number,
}


class RecordError(ValueError):
    """A record that does not follow the schema; the message names the record and the field."""


@dataclass(frozen=True)
class UserRecord:
    """One validated record, tokenized and split for the runner (the fields it reads)."""

    task: str
    length: int
    index: int
    context_ids: list[int]
    suffix_ids: list[int]
    references: list[str]
    max_new_tokens: int
    scorer: str
    tag: str
    row_fields: dict = field(default_factory=dict)
    seed: int = 0
    depth: float | None = None


def _where(number: int, line: int) -> str:
    return f"record {number} (line {line})"


def check_record(obj, number: int, line: int, scorer_names) -> dict:
    """The record ``obj`` with defaults filled in, or :class:`RecordError` naming the field."""
    at = _where(number, line)
    if not isinstance(obj, dict):
        raise RecordError(f"{at}: must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise RecordError(f"{at}: unknown field(s) {unknown}; allowed {list(FIELDS)}")
    bad = lambda f, why: RecordError(f"{at}: field {f!r}: {why} (got {obj.get(f)!r:.80})")
    if ("messages" in obj) == ("text" in obj):
        raise RecordError(f"{at}: give exactly one of 'messages' (chat) or 'text' (raw prompt)")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise bad("messages", "must be a non-empty list of {'role', 'content'} objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or set(m) != {"role", "content"}:
                raise bad("messages", f"message {i} must be an object with exactly 'role' and 'content'")
            if m["role"] not in ROLES or not isinstance(m["content"], str):
                raise bad("messages", f"message {i}: role must be one of {list(ROLES)} and content a string")
        if msgs[-1]["role"] != "user" or not msgs[-1]["content"]:
            raise bad("messages", "the last message must be a non-empty 'user' message (the model answers it)")
        last = msgs[-1]["content"]
    else:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise bad("text", "must be a non-empty string")
        last = obj["text"]
    for f in ("question", "answer_prefix", "task"):
        if f in obj and not isinstance(obj[f], str):
            raise bad(f, "must be a string")
    if obj.get("question") == "" or ("question" in obj and obj["question"] not in last):
        raise bad("question", "must be a non-empty string that occurs in the last message (or in 'text')")
    answers = obj.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise bad("answers", 'must be a non-empty list of non-empty strings, e.g. ["42"]')
    scorer = obj.get("scorer", "contains")
    if scorer not in scorer_names:
        raise bad("scorer", f"unknown scorer; allowed {sorted(scorer_names)}")
    n = obj.get("max_new_tokens", 32)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS:
        raise bad("max_new_tokens", f"must be an integer from 1 to {MAX_NEW_TOKENS}")
    if "id" in obj and (isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int))):
        raise bad("id", "must be a string or an integer")
    length = obj.get("length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise bad("length", "must be a positive integer")
    if "meta" in obj and not isinstance(obj["meta"], dict):
        raise bad("meta", "must be an object")
    return {**obj, "answer_prefix": obj.get("answer_prefix", ""), "answers": answers, "scorer": scorer,
            "max_new_tokens": n}


def read_records(path: Path, scorer_names=tuple(SCORERS)) -> list[tuple[int, dict]]:
    """``(line, record)`` pairs of a JSONL file, each checked by :func:`check_record`."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"--records {path}: no such file")
    out, ids = [], {}
    for line, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        number = len(out) + 1
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path}: {_where(number, line)}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        try:
            rec = check_record(obj, number, line, scorer_names)
        except RecordError as exc:
            raise RecordError(f"{path}: {exc}") from None
        if "id" in rec:
            if rec["id"] in ids:
                raise RecordError(f"{path}: {_where(number, line)}: field 'id': {rec['id']!r} repeats record {ids[rec['id']]}")
            ids[rec["id"]] = number
        out.append((line, rec))
    if not out:
        raise RecordError(f"--records {path}: holds no records")
    return out


def _prompt(tokenizer, rec: dict, at: str) -> tuple[str, int]:
    """The rendered prompt and the character where decoding starts."""
    prefix = rec["answer_prefix"]
    if "text" in rec:  # a base model's plain text starts with BOS where its tokenizer adds one
        lead = "" if getattr(tokenizer, "chat_template", None) else plain_bos(tokenizer)
        full, body = lead + rec["text"] + prefix, rec["text"]
        start = len(lead)
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise RecordError(f"{at}: field 'messages': this model's tokenizer has no chat template; give 'text'")
        full = tokenizer.apply_chat_template(rec["messages"], tokenize=False, add_generation_prompt=True) + prefix
        body = rec["messages"][-1]["content"]
        start = full.rfind(body, 0, len(full) - len(prefix))
        if start < 0:
            raise RecordError(f"{at}: field 'messages': the chat template altered the last message's text")
    if "question" not in rec:
        return full, start + len(body)
    return full, start + body.rfind(rec["question"])


def prepare(tokenizer, rec: dict, index: int, line: int, default_task: str) -> UserRecord:
    """Tokenize a checked record and split it into the prefilled document and the decoded suffix."""
    from kvlocks_lab.eval.tasks.build import split_prompt

    at = _where(index + 1, line)
    full, cut = _prompt(tokenizer, rec, at)
    _, _, ctx, sfx = split_prompt(tokenizer, full, cut, straddle="suffix")
    if not ctx:
        raise RecordError(f"{at}: nothing to prefill before the decoded part; put the document before it")
    tokens = len(ctx) + len(sfx) + rec["max_new_tokens"]
    length = rec.get("length") or max(256, 1 << (tokens - 1).bit_length())
    digest = hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:12]
    task = rec.get("task", default_task)
    fields = {"id": rec.get("id"), "scorer": rec["scorer"], "record_hash": digest, "meta": rec.get("meta")}
    return UserRecord(task=task, length=length, index=index, context_ids=ctx, suffix_ids=sfx,
                      references=list(rec["answers"]), max_new_tokens=rec["max_new_tokens"], scorer=rec["scorer"],
                      tag=f"{task}-{index}-{digest}", row_fields=fields)
