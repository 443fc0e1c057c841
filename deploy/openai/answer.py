"""A chat choice's output read as its answer: reasoning apart (deploy/openai/reasoning.py), tool calls out of the
text (deploy/openai/tools.py), the rest `content`; the same whole and streamed."""

from __future__ import annotations

from dataclasses import dataclass

from deploy.openai.api import AssistantMessage, Delta
from deploy.openai.reasoning import Thinking
from deploy.openai.tools import HermesCalls, OutToolCall, ToolUse, delta_calls


@dataclass(frozen=True)
class Answer:
    """One choice's reader: `delta` each streamed text (the last with its finish reason), or `message` the whole."""

    thinking: Thinking | None  # the reasoning split, where the model thinks
    calls: HermesCalls | None  # the tool call reader, where the request's tools are parsed

    @classmethod
    def of(cls, tools: ToolUse | None, thinks: bool | None) -> Answer:
        """`thinks`: None where the model's reasoning is not split, else whether its output starts inside it."""
        calls = HermesCalls(tools.names, tools.parallel) if tools is not None and tools.parse else None
        return cls(None if thinks is None else Thinking(thinks), calls)

    def delta(self, text: str, reason: str | None) -> tuple[Delta | None, str | None]:
        """A stream chunk's delta of the next text (None where it holds nothing yet), and its finish reason."""
        sent = self.made
        reasoning, content, calls = self._feed(text, final=reason is not None)
        found = delta_calls(calls, sent) or None
        if not (reasoning or content or found):
            return None, self.finish_reason(reason)
        return Delta(reasoning_content=reasoning or None, content=content or None, tool_calls=found), (
            self.finish_reason(reason)
        )

    def message(self, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message and finish reason."""
        reasoning, content, calls = self._feed(text, final=True)
        answer = content or (None if calls or reasoning else content)  # calls, or reasoning cut off: no content
        message = AssistantMessage(content=answer, reasoning_content=reasoning or None, tool_calls=calls or None)
        return message, self.finish_reason(reason)

    @property
    def made(self) -> int:
        """Tool calls read so far."""
        return self.calls.made if self.calls is not None else 0

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for a choice that stopped after making calls (OpenAI's and vLLM's), else the router's."""
        return "tool_calls" if reason == "stop" and self.made else reason

    def _feed(self, text: str, final: bool) -> tuple[str, str, list[OutToolCall]]:
        """What `text` adds: reasoning, answer text, and the tool calls completed in it."""
        reasoning, content = "", text
        if self.thinking is not None:
            split = self.thinking.feed(text, final)
            reasoning, content = split.reasoning, split.content
        if self.calls is None:
            return reasoning, content, []
        parsed = self.calls.feed(content, final)
        return reasoning, parsed.content, parsed.calls
