"""The drafter's configuration and its builder."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PreTrainedModel

from speculative.drafters.base import Drafter
from speculative.drafters.eagle import EagleModel, EagleTrees, load_eagle
from speculative.drafters.heads import TreeHeads
from speculative.drafters.hybrid import HybridDrafter
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.drafters.medusa import DEFAULT_CHOICES, MedusaHeads, MedusaTrees, check_choices, load_medusa
from speculative.drafters.model import DraftModelDrafter
from speculative.engine.loading import eos_ids_of
from speculative.engine.runner import ModelRunner
from speculative.rules.grammar import GrammarCompiler


class DrafterConfig(BaseModel):
    """What proposes draft tokens, and the shape of its proposals."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["none", "model", "lookup", "hybrid", "medusa", "eagle"] = Field(
        "model",
        description="none: plain decoding; model: a draft LM; lookup: n-gram prompt lookup; "
        "hybrid: lookup where it finds a match, else the draft LM; medusa: Medusa heads on the target "
        "(`medusa_heads`), their guesses drafted as the tree of `medusa_choices`, no draft pool; eagle: an "
        "EAGLE head on the target (`eagle_head`) drafting a dynamic tree from its features, no draft pool.",
    )
    tree_width: int = Field(
        1, ge=1, le=16, description="1 drafts a chain; w > 1 gives each expanded node w children, w nodes per depth."
    )
    tree_nodes: int = Field(16, ge=1, le=256, description="Most draft nodes in one tree (bounds verify cost).")
    sampled: bool = Field(
        True,
        description="Under sampling: draw drafts from q and verify by rejection sampling (higher acceptance); "
        "False drafts top-k and verifies by target-sample matching (output identical to plain sampling).",
    )
    lookup_quotes: bool = Field(
        True,
        description="model: a sequence quoting its context (a prompt-lookup match agreeing for 8+ tokens, as code "
        "edits give) drafts by lookup in the router instead, at no draft cost, where its tokens do not depend "
        "on the drafter (greedy, or deterministic drafts). Under load quotes pay where the draft model no longer does. "
        "Always False for the other kinds (only a draft model has lookup drafted beside it).",
    )
    medusa_heads: str | None = Field(
        None, description="medusa: the heads' folder, in FasterDecoding/Medusa's layout (config.json + weights)."
    )
    medusa_choices: tuple[tuple[int, ...], ...] = Field(
        DEFAULT_CHOICES,
        description="medusa: the tree as Medusa choices, each a path of top-k ranks, one per head from the first "
        "(every prefix of a choice a choice too); the default has 15 nodes over 4 heads.",
    )
    medusa_top: int = Field(4, ge=1, le=64, description="medusa: best tokens kept per head (choices rank below it).")
    eagle_head: str | None = Field(
        None, description="eagle: the head's folder, in SafeAILab/EAGLE's layout (config.json + weights)."
    )
    eagle_top_k: int = Field(
        4, ge=1, le=32, description="eagle: nodes expanded per depth, and children drafted per expanded node."
    )
    eagle_depth: int = Field(5, ge=1, le=16, description="eagle: depths of the dynamic tree.")
    eagle_nodes: int = Field(16, ge=1, le=256, description="eagle: the tree's best-scored nodes kept (its size).")
    max_ngram: int = Field(3, ge=1, le=16, description="lookup: longest suffix n-gram matched.")
    min_ngram: int = Field(1, ge=1, le=16, description="lookup: shortest suffix n-gram matched.")

    @model_validator(mode="before")
    @classmethod
    def _lookup_quotes_beside_a_model(cls, data: Any) -> Any:
        """`lookup_quotes` holds only beside a draft model: with no model, lookup has nothing to sit beside."""
        if isinstance(data, dict) and data.get("kind", "model") != "model":
            data = {**data, "lookup_quotes": False}
        return data

    @model_validator(mode="after")
    def _medusa_needs_heads(self) -> DrafterConfig:
        if self.kind == "medusa":
            if self.medusa_heads is None:
                raise ValueError("medusa_heads: drafter kind 'medusa' needs the heads' folder")
            check_choices(self.medusa_choices, max(map(len, self.medusa_choices), default=0))
            deepest_rank = max((max(c) for c in self.medusa_choices), default=0)
            if deepest_rank >= self.medusa_top:
                raise ValueError(f"medusa_choices: rank {deepest_rank} needs medusa_top > {deepest_rank}")
        if self.kind == "eagle" and self.eagle_head is None:
            raise ValueError("eagle_head: drafter kind 'eagle' needs the head's folder")
        return self

    @property
    def on_target(self) -> bool:
        """Drafted by heads beside the target (the trees come back with the verdicts), no draft pool."""
        return self.kind in ("medusa", "eagle")

    @property
    def drafts_sampled(self) -> bool:
        """Under sampling, drafts are drawn from q and verified by rejection: depth changes a seeded output."""
        return self.sampled and self.kind in ("model", "hybrid")


def build_drafter(
    config: DrafterConfig,
    draft_model: PreTrainedModel | None,
    target_vocab: int,
    grammars: GrammarCompiler | None = None,
    reserve: tuple[int, int] | None = None,  # the draft KV cache's (rows, columns) at start (ModelRunner)
) -> Drafter | None:
    """`grammars`: the draft tokenizer's grammar compiler, masking the draft model's q (None: unmasked)."""
    if config.kind == "none":
        return None
    if config.kind == "lookup":
        return PromptLookupDrafter(config.max_ngram, config.min_ngram)
    if config.on_target:
        raise ValueError(f"drafter kind {config.kind!r} drafts beside the target (TargetVerifier(heads=...))")
    if draft_model is None:
        raise ValueError(f"drafter kind {config.kind!r} needs a draft model")
    model = DraftModelDrafter(
        ModelRunner(draft_model, reserve, lean=True),  # a draft's forwards are a few tokens: fewer calls
        target_vocab,
        tree_width=config.tree_width,
        tree_nodes=config.tree_nodes,
        sampled=config.sampled,
        eos_ids=eos_ids_of(draft_model),
        grammars=grammars,
    )
    if config.kind == "hybrid":
        # 1-gram matches are too weak to displace the model: hybrid matches 2-grams at least.
        lookup = PromptLookupDrafter(max(config.max_ngram, 2), max(config.min_ngram, 2))
        return HybridDrafter(lookup, model)
    return model


def load_heads(kind: str, path: str, model: PreTrainedModel) -> MedusaHeads | EagleModel:
    """Medusa heads or an EAGLE head from `path` in `model`'s dtype and device, checked against its hidden size
    and vocabulary (ValueError naming the path)."""
    dtype, device = next(model.parameters()).dtype, str(next(model.parameters()).device)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    if kind == "medusa":
        heads: MedusaHeads | EagleModel = load_medusa(path, dtype, device)
        shape = (heads.hidden, heads.vocab)
    elif kind == "eagle":
        heads = load_eagle(path, dtype, device)
        shape = (heads.shape.hidden, heads.shape.vocab)
    else:
        raise ValueError(f"drafter kind {kind!r} has no heads")
    if shape != (hidden, vocab):
        raise ValueError(
            f"{kind}.path {path}: heads of hidden size {shape[0]} and vocabulary {shape[1]} do not fit the target "
            f"(hidden {hidden}, vocabulary {vocab})"
        )
    return heads


def heads_factory(
    heads: MedusaHeads | EagleModel,
    model: PreTrainedModel,
    choices: Sequence[Sequence[int]] = DEFAULT_CHOICES,
    top: int = 4,
    top_k: int = 4,
    depth: int = 5,
    nodes: int = 16,
) -> Callable[[ModelRunner], TreeHeads]:
    """Per target runner (an EAGLE head keeps a cache per sequence), the `TreeHeads` over loaded `heads`
    (their weights shared): Medusa's tree of `choices` over each head's `top` tokens, or EAGLE's dynamic
    tree (`top_k`, `depth`, `nodes`) through the target's embedding and the runner's LM head."""
    if isinstance(heads, MedusaHeads):
        return lambda runner: MedusaTrees(heads, choices, top)
    embed = model.get_input_embeddings()
    return lambda runner: EagleTrees(heads, embed, runner.logits, top_k, depth, nodes)


def drafter_heads(config: DrafterConfig, model: PreTrainedModel) -> Callable[[ModelRunner], TreeHeads] | None:
    """`heads_factory` for a drafter of kind medusa or eagle (None for the other kinds)."""
    if not config.on_target:
        return None
    path = config.medusa_heads if config.kind == "medusa" else config.eagle_head
    assert path is not None  # (the config's validator)
    heads = load_heads(config.kind, path, model)
    c = config
    return heads_factory(heads, model, c.medusa_choices, c.medusa_top, c.eagle_top_k, c.eagle_depth, c.eagle_nodes)
