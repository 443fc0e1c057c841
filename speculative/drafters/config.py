"""One config type per drafter kind, each saying where its kind drafts and building its drafter.

`DrafterConfig` is their union, discriminated by `kind` (a YAML's `drafter: {kind: ..., ...}`; no
`kind` is kind model). Each kind takes only its own fields: a field of another kind is an error naming
it. Where a kind drafts (`runs_on`) decides what a served app deploys:

- `draft_pool`: a draft model in its own pool of replicas (model, hybrid); each draft step costs a
  forward of the draft model.
- `target`: heads on the target replica, drafting after each verdict beside its forward (medusa,
  eagle); no draft pool, the drafts ride back with the verdicts at the price of a longer verify.
- `router`: prompt lookup in the router itself (lookup); free.
- `nowhere`: plain decoding (none).

A new heads kind is a `HeadsKind` here (`load`, `trees`) in the `DrafterConfig` union, and its module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

from speculative.drafters.base import Drafter
from speculative.drafters.eagle import EagleModel, EagleTrees, load_eagle
from speculative.drafters.heads import TreeHeads
from speculative.drafters.hybrid import HybridDrafter
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.drafters.medusa import DEFAULT_CHOICES, MedusaHeads, MedusaTrees, check_choices, load_medusa
from speculative.drafters.model import DraftModelDrafter, DraftShape
from speculative.engine.captured import runner_for
from speculative.engine.kv_pool import KvPool
from speculative.engine.loading import eos_ids_of
from speculative.engine.runner import ModelRunner
from speculative.rules.grammar import GrammarCompiler

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RunsOn = Literal["draft_pool", "target", "router", "nowhere"]
# Per target runner (an EAGLE head keeps a cache per sequence), the heads drafting beside its forwards.
HeadsFactory = Callable[[ModelRunner], TreeHeads]

MaxNgram = Annotated[int, Field(ge=1, le=16, description="Longest suffix n-gram prompt lookup matches.")]
MinNgram = Annotated[int, Field(ge=1, le=16, description="Shortest suffix n-gram prompt lookup matches.")]


class DraftInputs(NamedTuple):
    """What a drafter is built from (`DrafterKind.build`)."""

    draft_model: PreTrainedModel | None
    target_vocab: int
    grammars: GrammarCompiler | None  # the draft tokenizer's grammar compiler, masking q (None: unmasked)
    reserve: tuple[int, int] | None  # the draft KV cache's (rows, columns) at start (ModelRunner)
    graphs: str = "off"  # captured forwards of the draft model (`engine.captured.runner_for`)
    pool: KvPool | None = None  # the draft replica's KV pool its runners draw on (None: unbounded)


class DrafterKind(BaseModel):
    """What every kind says: where it drafts, how its drafts are verified, and its drafter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(description="The kind's name, the `DrafterConfig` union's tag (each kind its own literal).")

    runs_on: ClassVar[RunsOn] = "nowhere"

    @property
    def on_target(self) -> bool:
        """Drafted by heads beside the target (the trees come back with the verdicts), no draft pool."""
        return self.runs_on == "target"

    @property
    def needs_draft_model(self) -> bool:
        """Drafted by a draft model: a served app deploys a draft pool for it."""
        return self.runs_on == "draft_pool"

    @property
    def drafts_sampled(self) -> bool:
        """Under sampling, drafts are drawn from q and verified by rejection: depth changes a seeded output."""
        return False

    @property
    def lookup_ngrams(self) -> tuple[int, int] | None:
        """(max, min) suffix n-gram of the prompt lookup the router runs itself; None: it runs none."""
        return None

    @property
    def quotes_in_router(self) -> bool:
        """The router's lookup sits beside a draft pool: it drafts the sequences quoting their context, the
        pool the rest."""
        return self.lookup_ngrams is not None and self.needs_draft_model

    def build(
        self,
        draft_model: PreTrainedModel | None,
        target_vocab: int,
        grammars: GrammarCompiler | None = None,
        reserve: tuple[int, int] | None = None,
        graphs: str = "off",
        pool: KvPool | None = None,
    ) -> Drafter | None:
        """The drafter of a draft replica or an in-process decoder (None: plain decoding). `grammars`: the
        draft tokenizer's grammar compiler, masking the draft model's q (None: unmasked); `reserve`: the
        draft KV cache's (rows, columns) at start (ModelRunner); `graphs`: the model's `graphs` setting;
        `pool`: the replica's KV pool (`engine.kv_pool`)."""
        return self._drafter(DraftInputs(draft_model, target_vocab, grammars, reserve, graphs, pool))

    def _drafter(self, given: DraftInputs) -> Drafter | None:
        """This kind's drafter of `given` (None: plain decoding)."""
        return None

    def build_heads(self, model: PreTrainedModel) -> HeadsFactory | None:
        """The heads a target replica runs beside `model` (None: this kind has none)."""
        return None


class NoDrafterConfig(DrafterKind):
    """Plain decoding: nothing drafts, nothing is deployed for drafting."""

    kind: Literal["none"] = Field("none", description="none: plain decoding.")


class LookupDrafterConfig(DrafterKind):
    """Prompt lookup: the router drafts continuations of suffix n-gram matches in the context, at no cost."""

    kind: Literal["lookup"] = Field("lookup", description="lookup: n-gram prompt lookup, drafted by the router.")
    max_ngram: MaxNgram = 3
    min_ngram: MinNgram = 1

    runs_on: ClassVar[RunsOn] = "router"

    @property
    def lookup_ngrams(self) -> tuple[int, int] | None:
        return self.max_ngram, self.min_ngram

    def _drafter(self, given: DraftInputs) -> Drafter | None:
        return PromptLookupDrafter(self.max_ngram, self.min_ngram)


class DraftModelKind(DrafterKind):
    """A draft model in the draft pool proposing chains or trees; each depth costs a draft forward."""

    tree_width: int = Field(
        1, ge=1, le=16, description="1 drafts a chain; w > 1 gives each expanded node w children, w nodes per depth."
    )
    tree_nodes: int = Field(16, ge=1, le=256, description="Most draft nodes in one tree (bounds verify cost).")
    sampled: bool = Field(
        True,
        description="Under sampling: draw drafts from q and verify by rejection sampling (higher acceptance); "
        "False drafts top-k and verifies by target-sample matching (output identical to plain sampling).",
    )

    runs_on: ClassVar[RunsOn] = "draft_pool"

    @property
    def drafts_sampled(self) -> bool:
        return self.sampled

    def _model_drafter(self, given: DraftInputs) -> DraftModelDrafter:
        if given.draft_model is None:
            raise ValueError(f"drafter kind {self.kind!r} needs a draft model")
        return DraftModelDrafter(
            # lean: a draft's forwards are a few tokens
            runner_for(given.draft_model, given.graphs, given.reserve, lean=True, pool=given.pool),
            given.target_vocab,
            DraftShape(self.tree_width, self.tree_nodes, self.sampled),
            eos_ids=eos_ids_of(given.draft_model),
            grammars=given.grammars,
        )


class ModelDrafterConfig(DraftModelKind):
    """A draft model; sequences quoting their context draft by prompt lookup in the router instead."""

    kind: Literal["model"] = Field("model", description="model: a draft LM in the draft pool.")
    lookup_quotes: bool = Field(
        True,
        description="A sequence quoting its context (a prompt-lookup match agreeing for 8+ tokens, as code edits "
        "give) drafts by lookup in the router instead, at no draft cost, where its tokens do not depend on the "
        "drafter (greedy, or deterministic drafts); so does a shorter match where lookup's drafts from runs that long "
        "land at least as often as the model's, or where the model's draft would not pay. Under load quotes pay "
        "where the draft model no longer does.",
    )
    max_ngram: MaxNgram = 3
    min_ngram: MinNgram = 1

    @property
    def lookup_ngrams(self) -> tuple[int, int] | None:
        return (self.max_ngram, self.min_ngram) if self.lookup_quotes else None

    def _drafter(self, given: DraftInputs) -> Drafter | None:
        return self._model_drafter(given)


class HybridDrafterConfig(DraftModelKind):
    """Prompt lookup where it finds a match, else the draft model: both run in the draft pool."""

    kind: Literal["hybrid"] = Field("hybrid", description="hybrid: lookup where it matches, else the draft LM.")
    max_ngram: MaxNgram = 3
    min_ngram: MinNgram = 1

    def _drafter(self, given: DraftInputs) -> Drafter | None:
        model = self._model_drafter(given)
        # 1-gram matches are too weak to displace the model: hybrid matches 2-grams at least.
        lookup = PromptLookupDrafter(max(self.max_ngram, 2), max(self.min_ngram, 2))
        return HybridDrafter(lookup, model)


class HeadsKind(DrafterKind):
    """Heads on the target replica drafting after each verdict from its hidden states (no draft pool)."""

    runs_on: ClassVar[RunsOn] = "target"

    def load(self, model: PreTrainedModel) -> Any:
        """The heads' weights, in `model`'s dtype and device, checked against it (ValueError naming the path)."""
        raise NotImplementedError

    def trees(self, heads: Any, model: PreTrainedModel) -> HeadsFactory:
        """Per target runner, the `TreeHeads` over loaded `heads` (their weights shared)."""
        raise NotImplementedError

    def _drafter(self, given: DraftInputs) -> Drafter | None:
        raise ValueError(f"drafter kind {self.kind!r} drafts beside the target (build_heads)")

    def build_heads(self, model: PreTrainedModel) -> HeadsFactory | None:
        return self.trees(self.load(model), model)


def _fits(field: str, path: str, shape: tuple[int, int], model: PreTrainedModel) -> None:
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    if shape != (hidden, vocab):
        raise ValueError(
            f"{field} {path}: heads of hidden size {shape[0]} and vocabulary {shape[1]} do not fit the target "
            f"(hidden {hidden}, vocabulary {vocab})"
        )


def _placement(model: PreTrainedModel) -> tuple[Any, str]:
    weight = next(model.parameters())
    return weight.dtype, str(weight.device)


class MedusaDrafterConfig(HeadsKind):
    """Medusa heads on the target (speculative/drafters/medusa.py), their guesses drafted as a fixed tree."""

    kind: Literal["medusa"] = Field("medusa", description="medusa: Medusa heads on the target replica.")
    medusa_heads: str = Field(
        min_length=1, description="The heads' folder, in FasterDecoding/Medusa's layout (config.json + weights)."
    )
    medusa_choices: tuple[tuple[int, ...], ...] = Field(
        DEFAULT_CHOICES,
        description="The tree as Medusa choices, each a path of top-k ranks, one per head from the first "
        "(every prefix of a choice a choice too); the default has 15 nodes over 4 heads.",
    )
    medusa_top: int = Field(4, ge=1, le=64, description="Best tokens kept per head (choices rank below it).")

    @model_validator(mode="after")
    def _choices_fit(self) -> MedusaDrafterConfig:
        check_choices(self.medusa_choices, max(map(len, self.medusa_choices), default=0))
        deepest_rank = max((max(c) for c in self.medusa_choices), default=0)
        if deepest_rank >= self.medusa_top:
            raise ValueError(f"medusa_choices: rank {deepest_rank} needs medusa_top > {deepest_rank}")
        return self

    def load(self, model: PreTrainedModel) -> MedusaHeads:
        heads = load_medusa(self.medusa_heads, *_placement(model))
        _fits("medusa_heads", self.medusa_heads, (heads.hidden, heads.vocab), model)
        return heads

    def trees(self, heads: MedusaHeads, model: PreTrainedModel) -> HeadsFactory:
        return lambda runner: MedusaTrees(heads, self.medusa_choices, self.medusa_top)


class EagleDrafterConfig(HeadsKind):
    """An EAGLE head on the target (speculative/drafters/eagle.py) drafting a dynamic tree from its features."""

    kind: Literal["eagle"] = Field("eagle", description="eagle: an EAGLE head on the target replica.")
    eagle_head: str = Field(
        min_length=1, description="The head's folder, in SafeAILab/EAGLE's layout (config.json + weights)."
    )
    eagle_top_k: int = Field(4, ge=1, le=32, description="Nodes expanded per depth, and children per expanded node.")
    eagle_depth: int = Field(5, ge=1, le=16, description="Depths of the dynamic tree.")
    eagle_nodes: int = Field(16, ge=1, le=256, description="The tree's best-scored nodes kept (its size).")

    def load(self, model: PreTrainedModel) -> EagleModel:
        head = load_eagle(self.eagle_head, *_placement(model))
        _fits("eagle_head", self.eagle_head, (head.shape.hidden, head.shape.vocab), model)
        return head

    def trees(self, heads: EagleModel, model: PreTrainedModel) -> HeadsFactory:
        embed = model.get_input_embeddings()
        top_k, depth, nodes = self.eagle_top_k, self.eagle_depth, self.eagle_nodes
        return lambda runner: EagleTrees(heads, embed, runner.logits, top_k, depth, nodes)


def _kind_model_by_default(data: Any) -> Any:
    """A mapping without `kind` is kind model (the YAML's `drafter: {tree_width: 2}`)."""
    if isinstance(data, Mapping) and "kind" not in data:
        return {"kind": "model", **data}
    return data


DrafterConfig = Annotated[
    NoDrafterConfig
    | ModelDrafterConfig
    | LookupDrafterConfig
    | HybridDrafterConfig
    | MedusaDrafterConfig
    | EagleDrafterConfig,
    Field(discriminator="kind"),
    BeforeValidator(_kind_model_by_default),
]

_ADAPTER: TypeAdapter[DrafterConfig] = TypeAdapter(DrafterConfig)


def drafter_config(data: Mapping[str, Any] | None = None, /, **fields: Any) -> DrafterConfig:
    """The config of the kind `data` (or `fields`) names, validated: `drafter_config(kind="lookup")`."""
    return _ADAPTER.validate_python({**(data or {}), **fields})


def heads_factory(heads: MedusaHeads | EagleModel, model: PreTrainedModel) -> HeadsFactory:
    """The `TreeHeads` over heads held in memory (training's evaluation), in their kind's default tree."""
    if isinstance(heads, MedusaHeads):
        return MedusaDrafterConfig(kind="medusa", medusa_heads="(in memory)").trees(heads, model)
    return EagleDrafterConfig(kind="eagle", eagle_head="(in memory)").trees(heads, model)
