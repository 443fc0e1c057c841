"""An in-process speculative decoder from model names: the CLI's `generate` and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from deploy.models import resolve
from speculative.costs import StepCosts
from speculative.decoder import SpeculativeDecoder
from speculative.depth import DepthConfig
from speculative.drafters.config import DrafterConfig, build_drafter
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.grammar import GrammarCompiler
from speculative.loading import LoadedModel, load_model
from speculative.runner import ModelRunner
from speculative.target import TargetVerifier


@dataclass(frozen=True)
class LocalModels:
    target: LoadedModel
    draft: LoadedModel | None

    @staticmethod
    def load(target: str, draft: str | None, dtype: str) -> LocalModels:
        """`target` / `draft`: registry names (deploy/models.py), local folders or hub ids."""
        return LocalModels(load_model(resolve(target), dtype), load_model(resolve(draft), dtype) if draft else None)

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
        return SpeculativeDecoder(
            TargetVerifier(target_runner, grammars=GrammarCompiler.lazy(lambda: tokenizer)),
            build_drafter(drafter, draft_model, target_runner.vocab_size, draft_grammars),
            depth,
            eos_ids=self.target.eos_ids,
            decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
            costs=costs,
            drafts_sampled=drafter.drafts_sampled,
            lookup_quotes=PromptLookupDrafter(drafter.max_ngram, drafter.min_ngram) if drafter.lookup_quotes else None,
        )

    def chat_prompt(self, user: str) -> list[int]:
        """Token ids of a one-turn chat in the target's own template (plain text if it has none)."""
        tok = self.tokenizer
        text = user
        if tok.chat_template:
            text = str(
                tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
            )
        return list(tok(text, add_special_tokens=not tok.chat_template)["input_ids"])
