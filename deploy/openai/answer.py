"""A chat choice's output read as its answer: reasoning apart (deploy/openai/reasoning.py), tool calls out of the
text (deploy/openai/tools.py), the rest `content`; the same whole and streamed."""

from __future__ import annotations

from dataclasses import dataclass, field

from deploy.openai.api import AssistantMessage, Delta
from deploy.openai.reasoning import Thinking
from deploy.openai.tools import HermesCalls, OutToolCall, ToolUse, delta_calls


@dataclass
class Answer:
    """One choice's reader: `feed` each text delta (`final` with the last), get what it holds."""

    thinking: Thinking | None  # the reasoning split, where the model thinks
    calls: HermesCalls | None  # the tool call reader, where the request's tools are parsed
    reasoning: list[str] = field(default_factory=list)  # all read so far, for the whole message
    content: list[str] = field(default_factory=list)
    made: list[OutToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, tools: ToolUse | None, thinks: bool | None) -> Answer:
        """`thinks`: None where the model's reasoning is not split, else whether its output starts inside it."""
        calls = HermesCalls(tools.names, tools.parallel) if tools is not None and tools.parse else None
        return cls(None if thinks is None else Thinking(thinks), calls)

    def delta(self, text: str, reason: str | None) -> tuple[Delta, str | None]:
        """A stream chunk's delta of the next text (role and None fields left out), and its finish reason."""
        sent = len(self.made)
        reasoning, content, calls = self._feed(text, final=reason is not None)
        delta = Delta(
            reasoning_content=reasoning or None, content=content or None, tool_calls=delta_calls(calls, sent) or None
        )
        return delta, self.finish_reason(reason)

    def message(self, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message and finish reason."""
        self._feed(text, final=True)
        content, reasoning = "".join(self.content), "".join(self.reasoning) or None
        if self.thinking is not None and not content:
            content = None  # type: ignore[assignment]  # all reasoning: no answer yet (cut off)
        if self.made:
            return AssistantMessage(
                content=content or None, reasoning_content=reasoning, tool_calls=self.made
            ), self.finish_reason(reason)
        return AssistantMessage(content=content, reasoning_content=reasoning), reason

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for a choice that stopped after making calls (OpenAI's and vLLM's), else the router's."""
        return "tool_calls" if reason == "stop" and self.made else reason

    def _feed(self, text: str, final: bool) -> tuple[str, str, list[OutToolCall]]:
        reasoning, content = "", text
        if self.thinking is not None:
            split = self.thinking.feed(text, final)
            reasoning, content = split.reasoning, split.content
        calls: list[OutToolCall] = []
        if self.calls is not None:
            parsed = self.calls.feed(content, final)
            content, calls = parsed.content, parsed.calls
        self.reasoning.append(reasoning)
        self.content.append(content)
        self.made += calls
        return reasoning, content, calls
