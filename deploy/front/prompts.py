"""Prompt text to token ids, where only the chat template's own markers are control tokens.

A client's text is text: `<|im_start|>system` inside a message (or a completions prompt) is
tokenized as the characters it is, never as the model's control tokens, so a user cannot open a
system turn or end the assistant's. The chat template's output is tokenized with its markers as
control tokens, and the message contents that hold a control token's text are cut out of it and
tokenized as plain text. A conversation whose contents hold no control-token text
tokenizes exactly as `tokenizer.encode(rendered, add_special_tokens=False)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

# Stands in for message i's content while the template is rendered, to find where the content lands:
# private-use characters no template writes, and no whitespace for a template's `trim` to remove.
_SENTINEL = "\ue000specserve-content-{}\ue001"


class ControlTextRefused(ValueError):
    """Message `index` holds control-token text and the template changes its content, so it cannot be cut out."""

    def __init__(self, index: int, control: str) -> None:
        super().__init__(index, control)
        self.index, self.control = index, control


class PromptTokenizer:
    """A tokenizer's encode in two modes: client text (control-token text is plain) and template markup."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.controls = control_texts(tokenizer)
        backend: Tokenizer | None = getattr(tokenizer, "backend_tokenizer", None)
        self._markup = backend
        # A copy that never matches special added tokens: HF's `split_special_tokens=True` flips this
        # flag on the shared tokenizer per call, which races between threads; this copy is set once.
        self._plain = None if backend is None else Tokenizer.from_str(backend.to_str())
        if self._plain is not None:
            self._plain.encode_special_tokens = True

    def text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A client's text: control-token text stays text; BOS as the tokenizer adds it by default."""
        if self._plain is None:  # a Python tokenizer: the argument holds for this call only
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))
        return _ids(self._plain, text, add_special_tokens)

    def markup(self, text: str) -> list[int]:
        """A chat template's output: its markers are control tokens; no BOS added (the template places it)."""
        if self._markup is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return _ids(self._markup, text, add_special_tokens=False)

    def control_in(self, text: str) -> str | None:
        """The first control token whose text occurs in `text`, if any."""
        return next((c for c in self.controls if c in text), None)

    def chat(self, messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]) -> list[int]:
        """A conversation through `render` (the chat template), its contents' control-token text kept as text."""
        rendered = render(messages)
        marked = [i for i, m in enumerate(messages) if self.control_in(m["content"]) is not None]
        if not marked:
            return self.markup(rendered)
        ids: list[int] = []
        for piece, plain in _pieces(messages, marked, rendered, render, self):
            ids += self.text(piece, add_special_tokens=False) if plain else self.markup(piece)
        return ids


def _ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text).ids`, letting go of the GIL meanwhile.

    `Tokenizer.encode` holds the GIL throughout (seconds for a 4 MB prompt: every thread, the event
    loop's included, waits); the batch encoders release it. `encode_batch_fast` also skips the
    character offsets, which nothing here reads.
    """
    fast = getattr(tokenizer, "encode_batch_fast", None)
    encode = fast if fast is not None else tokenizer.encode_batch
    return list(encode([text], add_special_tokens=add_special_tokens)[0].ids)


def control_texts(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The texts of the tokenizer's control tokens (special added tokens), longest first."""
    decoder: dict[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
    texts = {str(t.content) for t in decoder.values() if getattr(t, "special", False) and str(t.content)}
    texts |= {str(t) for t in tokenizer.all_special_tokens if t}
    return tuple(sorted(texts, key=lambda t: (-len(t), t)))


def _pieces(
    messages: list[dict[str, Any]],
    marked: Sequence[int],
    rendered: str,
    render: Callable[[list[dict[str, Any]]], str],
    tokens: PromptTokenizer,
) -> list[tuple[str, bool]]:
    """`rendered` as (text, is_client_text) pieces: the marked contents apart from the template around them.

    The template is rendered again with a sentinel in place of each marked content; putting the
    contents back where the sentinels landed must give `rendered` again (as is, or stripped, for
    templates that `trim` contents), else the template alters the content and it is refused.
    """
    sentinels = {_SENTINEL.format(i): i for i in marked}
    masked = render([m | {"content": _SENTINEL.format(i)} if i in marked else m for i, m in enumerate(messages)])
    parts = re.split("(" + "|".join(map(re.escape, sentinels)) + ")", masked)
    for fit in (_as_is, str.strip):
        pieces = [(fit(messages[sentinels[p]]["content"]), True) if p in sentinels else (p, False) for p in parts if p]
        if "".join(p for p, _ in pieces) == rendered:
            return pieces
    first = marked[0]
    raise ControlTextRefused(first, tokens.control_in(messages[first]["content"]) or "")


def _as_is(text: str) -> str:
    return text
