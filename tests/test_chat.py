"""The user turn rendered after a cached chat turn (kvlocks.chat.next_user_turn)."""

from __future__ import annotations

import pytest

from kvlocks.chat import next_user_turn


class _Template:
    """A tokenizer stand-in with a hand-written template: a system line before the first turn."""

    def __init__(self, alternate: bool = False):
        self.alternate = alternate

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        if self.alternate and len(msgs) > 1:
            raise ValueError("Conversation roles must alternate user/assistant")
        text = "<sys>S</sys>" + "".join(f"<u>{m['content']}</u>" for m in msgs)
        return text + ("<a>" if add_generation_prompt else "")


def test_next_turn_is_the_second_turn_without_a_second_system_prompt():
    assert next_user_turn(_Template(), "Q?") == "<u>Q?</u><a>"
    assert next_user_turn(_Template(), "Q?", add_generation_prompt=False) == "<u>Q?</u>"


def test_a_template_refusing_two_user_turns_renders_the_turn_alone():
    assert next_user_turn(_Template(alternate=True), "Q?") == "<sys>S</sys><u>Q?</u><a>"


def test_bundled_template_prefix_plus_next_turn_is_the_two_turn_conversation():
    from kvlocks.models import load

    _, tok = load("smollm2-135m")
    doc, q = "A document with a fact.", "What is the fact?"
    first = tok.apply_chat_template([{"role": "user", "content": doc}], tokenize=False)
    both = tok.apply_chat_template([{"role": "user", "content": doc}, {"role": "user", "content": q}],
                                   tokenize=False, add_generation_prompt=True)
    turn = next_user_turn(tok, q)
    assert first + turn == both
    assert "system" not in turn and turn.count("<|im_start|>") == 2


@pytest.mark.parametrize("bad", [None, "", "not json", "[1, 2]", '{"chat": "yes"}'])
def test_cache_header_chat_flag_is_false_unless_the_reference_says_true(bad):
    from kvlocks.commands.common import _made_with_chat

    assert _made_with_chat(bad) is False
    assert _made_with_chat('{"chat": true, "repeat": true}') is True
