"""A thinking model's reasoning apart from its answer (deploy/openai/reasoning.py): the split of output text, whole
and streamed in any pieces, and `reasoning_content` through the HTTP front door with the `openai` client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from deploy.openai.reasoning import Thinking, opens_thinking, parser_for
from tests.front_router import CHAT_TEMPLATE, MODEL_NAME, TinyIngress, front_door, serve_in_thread, tiny_pair
from tests.front_router import tiny_tokenizer as tokenizer_with

# (output, whether the prompt opened the reasoning) -> (reasoning, content)
CASES: list[tuple[str, bool, str, str]] = [
    ("no thinking here", False, "", "no thinking here"),
    ("<think>\nhmm, 2 + 2</think>\n\nIt is 4.", False, "\nhmm, 2 + 2", "It is 4."),
    ("  <think>a</think>b", False, "a", "b"),
    ("hmm, 2 + 2</think>\n\nIt is 4.", True, "hmm, 2 + 2", "It is 4."),
    ("cut off before the end", True, "cut off before the end", ""),
    ("a </thin b", True, "a </thin b", ""),
    ("<thinking> is a word", False, "", "<thinking> is a word"),
    ("<thi", False, "", "<thi"),
    ("</think>", True, "", ""),
]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_the_split_is_the_same_however_the_text_streams(
    text: str, inside: bool, reasoning: str, content: str, step: int
) -> None:
    reader = Thinking(inside)
    got_reasoning, got_content = "", ""
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        split = reader.feed(piece, final=k == len(pieces) - 1)
        got_reasoning, got_content = got_reasoning + split.reasoning, got_content + split.content
    assert (got_reasoning, got_content) == (reasoning, content)


def test_the_parser_follows_the_template_and_the_config() -> None:
    assert parser_for("auto", "{{ '<think>' }}...{{ '</think>' }}") == "think"
    assert parser_for("auto", "<|im_start|>assistant") is None and parser_for("auto", None) is None
    assert parser_for("none", "</think>") is None and parser_for("think", None) == "think"
    assert opens_thinking("<|assistant|><think>\n") and not opens_thinking("<|assistant|>")


THINKING_TEMPLATE = CHAT_TEMPLATE + "{% if add_generation_prompt %}<think>{% endif %}"  # opens the reasoning


@pytest.fixture(scope="module")
def clients() -> Iterator[dict[str, openai.OpenAI]]:
    """The tiny model behind two front doors of one template that opens `<think>`: split, and not."""
    tokenizer = tokenizer_with(last=("<think>", "</think>"))
    tokenizer.chat_template = THINKING_TEMPLATE
    models = tiny_pair()
    out = {}
    with (
        serve_in_thread(
            TinyIngress(front_door(tokenizer, 64, reasoning_parser="think"), *models).__serve_build_asgi_app__()
        ) as split,
        serve_in_thread(
            TinyIngress(front_door(tokenizer, 64, reasoning_parser="none"), *models).__serve_build_asgi_app__()
        ) as whole,
    ):
        for name, url in (("split", split), ("whole", whole)):
            out[name] = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield out


def test_reasoning_content_holds_what_the_model_thinks_streamed_and_not(clients: dict[str, openai.OpenAI]) -> None:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello there !"}],
        "temperature": 0.0,
        "max_tokens": 8,
        "extra_body": {"ignore_eos": True, "skip_special_tokens": False},
    }
    whole = clients["whole"].chat.completions.create(**body).choices[0].message
    assert whole.content and "</think>" not in whole.content  # the tiny model never ends its thinking
    split = clients["split"].chat.completions.create(**body).choices[0].message
    assert split.content is None and (split.model_extra or {}).get("reasoning_content") == whole.content
    reasoning, content = "", ""
    for chunk in clients["split"].chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.content, "")
