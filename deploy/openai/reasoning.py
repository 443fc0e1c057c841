"""The reasoning of models that think, apart from their answer: `reasoning_content` beside `content` in chat.

Models such as Qwen3 and DeepSeek-R1 write their reasoning between `<think>` and `</think>` before the answer;
their chat templates show it (and Qwen3's `enable_thinking` turns it off). vLLM's reasoning parsers move that
text into the message's `reasoning_content` (a stream's `delta.reasoning_content`), and clients written for
them read it there. `front_door.reasoning_parser`: `think` splits at the markers; `auto` (the default) does
where the chat template writes `</think>`; `none` leaves the text whole.

Where the output begins: in the reasoning when the rendered prompt ends with `<think>` (templates that open
it for the model, as DeepSeek-R1's does), else only when the output itself opens with `<think>`. The
reasoning ends at `</think>`; the whitespace right after it is dropped. Output cut off before `</think>`
is reasoning only. Streamed, a text ending that may be the start of a marker is held until the next delta
tells, so the split is the same streamed and not.
"""

from __future__ import annotations

from dataclasses import dataclass

from deploy.front.frontdoor import marker_start
from deploy.openai.prompts import template_format

OPEN, CLOSE = "<think>", "</think>"


def parser_for(configured: str, chat_template: str | None) -> str | None:
    """The reasoning format of `front_door.reasoning_parser`: `think`, or with `auto` where the template writes it."""
    return template_format(configured, chat_template, "think", CLOSE)


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside its reasoning (the template opened `<think>`)."""
    return prompt_text.rstrip().endswith(OPEN)


@dataclass(frozen=True)
class Split:
    """What a piece of output holds: reasoning, and answer text."""

    reasoning: str
    content: str


@dataclass
class Thinking:
    """A choice's output split as it streams (`feed` each delta, `final` with the last)."""

    inside: bool  # in the reasoning now (the prompt opened it)
    _start: bool = True  # nothing read yet: the output may still open with `<think>`
    _after: bool = False  # the reasoning just ended: leading whitespace is dropped
    _buffer: str = ""

    def feed(self, text: str, final: bool = False) -> Split:
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        if self._start and not self.inside:
            head = self._buffer.lstrip()
            if OPEN.startswith(head) and not final:
                return Split("", "")  # may still open the reasoning
            self._start = False
            if head.startswith(OPEN):
                self._buffer, self.inside = head[len(OPEN) :], True
        self._start = False
        if self.inside:
            end = self._buffer.find(CLOSE)
            if end < 0:
                held = 0 if final else marker_start(self._buffer, (CLOSE,))
                reasoning.append(self._buffer[: len(self._buffer) - held])
                self._buffer = self._buffer[len(self._buffer) - held :]
                return Split("".join(reasoning), "")
            reasoning.append(self._buffer[:end])
            self._buffer, self.inside, self._after = self._buffer[end + len(CLOSE) :], False, True
        if self._after:
            self._buffer = self._buffer.lstrip()
            self._after = not self._buffer and not final
        content.append(self._buffer)
        self._buffer = ""
        return Split("".join(reasoning), "".join(content))
