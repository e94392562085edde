"""router/reasoning.py: a thinking reply split into reasoning and content, whole and fed in
pieces split at every position (a tag may arrive in pieces)."""

from __future__ import annotations

import pytest

from raylm.router.reasoning import (
    ReasoningSplitter,
    detect_reasoning_parser,
    prompt_closes_thoughts,
    prompt_opens_thoughts,
    reasoning_token_count,
)


def _split(pieces: list[str], in_thoughts: bool) -> tuple[str, str]:
    splitter = ReasoningSplitter(in_thoughts)
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        part = splitter.feed(piece, finished=i == len(pieces) - 1)
        reasoning += part.reasoning
        content += part.content
    return reasoning, content


CASES = [  # (reply, starts in the thoughts, reasoning, content)
    ("<think>\nLet me add.\n</think>\n\n4", False, "\nLet me add.\n", "4"),  # Qwen3, model opens
    ("  <think>a</think>b", False, "a", "b"),
    ("The answer is 4.", False, "", "The answer is 4."),  # no thoughts at all
    ("4 <think> is text here", False, "", "4 <think> is text here"),  # only a leading tag opens
    ("Let me add.\n</think>\n\n4", True, "Let me add.\n", "4"),  # DeepSeek-R1: the prompt opened them
    ("<think>\nhm</think>4", True, "\nhm", "4"),  # a repeated <think> is dropped
    ("still thinking <", True, "still thinking <", ""),  # cut short inside the thoughts
    ("a</thinkX>b", True, "a</thinkX>b", ""),
    ("r</think>c</think>d", True, "r", "c</think>d"),  # the first close ends the thoughts
    ("<thi", False, "", "<thi"),  # a partial tag at the end is text
]


@pytest.mark.parametrize("reply, in_thoughts, reasoning, content", CASES)
def test_every_split_of_a_reply_gives_the_same_reasoning_and_content(reply, in_thoughts, reasoning, content):
    assert _split([reply], in_thoughts) == (reasoning, content)
    for cut in range(len(reply) + 1):
        assert _split([reply[:cut], reply[cut:]], in_thoughts) == (reasoning, content), cut
    assert _split(list(reply), in_thoughts) == (reasoning, content)  # one character at a time


def test_a_stream_tells_each_part_as_soon_as_it_is_sure():
    splitter = ReasoningSplitter(in_thoughts=False)
    assert splitter.feed("<thi").reasoning == ""  # maybe the tag: held back
    assert splitter.feed("nk>Plan").reasoning == "Plan" and splitter.in_thoughts
    assert splitter.feed(" more</th").reasoning == " more"  # maybe the close: held back
    part = splitter.feed("ink>\n\nDone")
    assert (part.reasoning, part.content, splitter.closed) == ("", "Done", True)


QWEN3_LIKE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
              "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined and "
              "enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
              "{# reasoning_content: <think> #}")
R1_LIKE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"


def test_the_parser_follows_the_chat_template():
    assert detect_reasoning_parser(QWEN3_LIKE) == "qwen3"
    assert detect_reasoning_parser(R1_LIKE) == "deepseek_r1"
    assert detect_reasoning_parser("{{ messages }}") == detect_reasoning_parser(None) == "none"
    assert prompt_opens_thoughts("<｜Assistant｜><think>\n") and not prompt_opens_thoughts("<think>\n\n</think>\n\n")
    assert prompt_closes_thoughts("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_closes_thoughts("<|im_start|>assistant\n") and not prompt_closes_thoughts("<think>\n")


def test_reasoning_tokens_count_up_to_the_closing_token():
    closed, thinking, plain = ReasoningSplitter(True), ReasoningSplitter(True), ReasoningSplitter(False)
    closed.feed("r</think>a", finished=True)
    thinking.feed("r", finished=True)
    plain.feed("a", finished=True)
    assert reasoning_token_count([5, 6, 9, 7], 9, closed) == 3
    assert reasoning_token_count([5, 6], 9, thinking) == 2  # never closed: all thoughts
    assert reasoning_token_count([5, 6], 9, plain) == 0
    assert reasoning_token_count([5, 6, 7], None, closed) is None  # the tag is not one token
