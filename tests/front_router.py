"""A small real router for the front-door tests: the Router's method shapes over SpeculativeDecoder.

`FrontRouter` has `actors.router.Router`'s public shape (`generate`, `generate_stream`, `info`,
`Overloaded` when full) and runs a real speculative decoder (tiny random Llama target, noisy-copy
draft) in this process's event loop: no Ray. `tiny_tokenizer()` is a real `tokenizers` WordLevel
tokenizer trained on a few sentences, with a chat template, sized to the tiny model's vocabulary.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from actors.records import usage, with_logprobs
from actors.router import Overloaded, collected
from deploy.front.frontdoor import FrontDoor, FrontDoorConfig
from deploy.grpc.ingress import GrpcIngress
from deploy.openai.http_ingress import OpenAIIngress
from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.grammar import GrammarCompiler
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier
from tests.tiny_models import VOCAB, noisy_copy, tiny_model

MODEL_NAME = "tiny-llama"
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }} </s> "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SENTENCES = [
    "the quick brown fox jumps over the lazy dog near a quiet river",
    "speculative decoding lets a small draft model propose tokens that a large target verifies",
    "every accepted token saves one forward pass of the big model while the output stays exact",
    "ray serve routes each request to a replica and scales pools on their own load",
    "hello world, how are you today? fine thanks, and you? hello there!",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white",
]


def tiny_tokenizer(last: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """WordLevel over the sentences' words and punctuation; exactly VOCAB ids, specials first. `last`: special
    tokens that take the last ids instead of filler (fill-in-the-middle markers), the others' ids unchanged."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=SPECIAL))
    filler = [f"w{i}" for i in range(VOCAB - tok.get_vocab_size() - len(last))]
    if filler:
        tok.add_tokens(filler)
    if last:
        tok.add_special_tokens(list(last))
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def front_door(
    tokenizer: PreTrainedTokenizerFast, context_window: int = 64, api_key: str | None = None, **config: Any
) -> FrontDoor:
    """The tiny model's front door; `config`: more FrontDoorConfig fields (e.g. unknown_fields)."""
    fields = {"served_model_name": MODEL_NAME, "api_key": api_key, "retry_after_s": 2} | config
    return FrontDoor(FrontDoorConfig.model_validate(fields), tokenizer, context_window)


class FrontRouter:
    """The router's generate / generate_stream / info, over a real SpeculativeDecoder in this event loop."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        eos_ids: frozenset[int],
        decode: Callable[[list[int]], str],
        max_active: int = 8,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`grammars`: the tokenizer's grammar compiler, for requests with structured output (target and draft)."""
        self.vocab = int(target.config.vocab_size)
        drafter = drafter_config(kind="model").build(draft, self.vocab, grammars)
        verifier = TargetVerifier(ModelRunner(target), grammars=grammars)
        self.decoder = SpeculativeDecoder(verifier, drafter, DepthConfig(), eos_ids, decode)
        self.eos_ids = eos_ids
        self.max_active = max_active
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._driver: asyncio.Task[None] | None = None

    async def info(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab, "eos_ids": sorted(self.eos_ids), "model": MODEL_NAME}

    async def ready(self) -> None:
        await self.info()  # the target is in this process: ready when it answers

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any] | None = None) -> dict[str, Any]:
        return await collected(self.generate_stream(prompt_token_ids, sampling))

    async def generate_stream(
        self, prompt_token_ids: list[int], sampling: dict[str, Any] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        params = SamplingParams.model_validate(sampling or {})
        if not prompt_token_ids or any(not 0 <= t < self.vocab for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids: must be a non-empty list of token ids in 0..{self.vocab - 1}")
        if len(self._queues) >= self.max_active:
            raise Overloaded(f"{len(self._queues)} sequences active (max_active_sequences)")
        seq_id = self.decoder.add(list(prompt_token_ids), params)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[seq_id] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        done = False
        try:
            while not done:
                chunk = await queue.get()
                done = chunk["finish_reason"] is not None
                yield chunk
        finally:
            self._queues.pop(seq_id, None)
            if not done:  # the client went away: free the sequence (between steps: the loop is ours)
                self.decoder.cancel(seq_id)

    @property
    def active(self) -> int:
        return len(self._queues)

    async def _drive(self) -> None:
        """Step the decoder while it has sequences; hand each step's tokens to their streams."""
        while self.decoder.has_work:
            outputs = self.decoder.step()
            finished = {s.seq_id: s for s in self.decoder.finished}
            self.decoder.finished = []
            running = finished | self.decoder.active
            for out in outputs:
                queue = self._queues.get(out.seq_id)
                if queue is None or (not out.new_tokens and out.finish_reason is None):
                    continue
                chunk: dict[str, Any] = {"token_ids": out.new_tokens, "finish_reason": out.finish_reason}
                if out.finish_reason is not None:
                    chunk["usage"] = usage(finished[out.seq_id])
                queue.put_nowait(with_logprobs(chunk, running[out.seq_id], len(out.new_tokens)))
            await asyncio.sleep(0)  # let the streams run between steps


class TinyIngress(OpenAIIngress, GrpcIngress, FrontRouter):
    """The ingress as build_app wires it (front-door mixins + the router), over the tiny router."""

    def __init__(self, front: FrontDoor, target: PreTrainedModel, draft: PreTrainedModel, **kwargs: Any) -> None:
        eos = frozenset({int(front.tokenizer.eos_token_id)})
        tokenizer = front.tokenizer
        FrontRouter.__init__(self, target, draft, eos, lambda ids: str(tokenizer.decode(ids)), **kwargs)
        self.front = front


def tiny_pair(seed: int = 0) -> tuple[PreTrainedModel, PreTrainedModel]:
    target = tiny_model("llama", seed=seed)
    return target, noisy_copy(target, noise=0.2)


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """An ASGI app on a real socket (uvicorn, one event loop in a thread); yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def save_tiny_pair(root: Path, positions: int | None = None) -> tuple[Path, Path, PreTrainedModel]:
    """`tiny_pair()` as HF folders `root/target` (with `tiny_tokenizer()`) and `root/draft`, as configs name
    models; also the target model itself (for reference outputs). `positions`: their
    max_position_embeddings (what bounds the served window), where a test needs longer sequences than
    1,024 tokens (RoPE's default type computes nothing from it: the outputs do not change)."""
    target, draft = tiny_pair()
    if positions is not None:
        target.config.max_position_embeddings = draft.config.max_position_embeddings = positions
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root / "target", root / "draft", target
