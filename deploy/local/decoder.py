"""An in-process speculative decoder from model names: the CLI's `generate` and the benchmarks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from modelstore import resolve
from speculative.decoder import Planning, SpeculativeDecoder
from speculative.drafters.config import DrafterConfig
from speculative.drafters.heads import TreeDrafter, TreeHeads
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.engine.invariant import make_deterministic
from speculative.engine.loading import LoadedModel, chat_ids, load_model, resolve_dtype
from speculative.engine.runner import ModelRunner
from speculative.planning.costs import StepCosts
from speculative.planning.depth import DepthConfig
from speculative.rules.grammar import GrammarCompiler
from speculative.target import TargetVerifier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalModels:
    target: LoadedModel
    draft: LoadedModel | None
    heads: dict[str, Callable[[ModelRunner], TreeHeads] | None] = field(default_factory=dict)  # by drafter config

    @staticmethod
    def load(target: str, draft: str | None, dtype: str) -> LocalModels:
        """`target` / `draft`: registry names (modelstore/), local folders or hub ids. A bfloat16 target's
        forwards are made batch invariant, as a served one's (`target_pool.deterministic: auto`)."""
        loaded = load_model(resolve(target), dtype)
        if resolve_dtype(dtype) == "bfloat16" and (why := make_deterministic(loaded.model)) is not None:
            logger.warning("target forwards are not batch invariant here: %s", why)
        return LocalModels(loaded, load_model(resolve(draft), dtype) if draft else None)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.target.tokenizer

    def decoder(self, drafter: DrafterConfig, depth: DepthConfig, costs: StepCosts | None = None) -> SpeculativeDecoder:
        """A fresh decoder (empty caches) over the loaded weights; `costs` caps depths by measured costs."""
        target_runner = ModelRunner(self.target.model)
        draft_model = self.draft.model if self.draft is not None else None
        tokenizer = self.tokenizer
        draft_tokenizer = self.draft.tokenizer if self.draft is not None else None
        draft_grammars = GrammarCompiler.lazy(lambda: draft_tokenizer) if draft_tokenizer is not None else None
        heads = self._heads(drafter)  # heads beside the target draft (medusa, eagle), no draft model
        ngrams = drafter.lookup_ngrams
        grammars = GrammarCompiler.lazy(lambda: tokenizer)
        verifier = TargetVerifier(target_runner, grammars=grammars, heads=heads(target_runner) if heads else None)
        return SpeculativeDecoder(
            verifier,
            TreeDrafter(verifier.drafted)
            if heads
            else drafter.build(draft_model, target_runner.vocab_size, draft_grammars),
            depth,
            eos_ids=self.target.eos_ids,
            decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
            planning=Planning(
                costs,
                drafter.drafts_sampled,
                PromptLookupDrafter(*ngrams) if drafter.quotes_in_router and ngrams else None,
            ),
        )

    def _heads(self, drafter: DrafterConfig) -> Callable[[ModelRunner], TreeHeads] | None:
        """The drafter's heads, loaded once per LocalModels and configuration (a decoder per prompt reuses them)."""
        if not drafter.on_target:
            return None
        key = drafter.model_dump_json()
        if key not in self.heads:
            self.heads[key] = drafter.build_heads(self.target.model)
        return self.heads[key]

    def chat_prompt(self, user: str) -> list[int]:
        """Token ids of a one-turn chat in the target's own template (plain text if it has none)."""
        return chat_ids(self.tokenizer, user)
