"""Fitting heads to a corpus of the target's features, within a time budget, on the CPU.

Both kinds keep the target's LM head frozen (Medusa's projections start as copies of it and stay so:
only the residual blocks learn; EAGLE uses the target's own), and score their logits over the corpus's
vocabulary only (`Corpus.vocabulary`, some ten thousand ids where the full one has 150k): the softmax
over the tokens that occur is what the labels can teach, at a tenth of the cost of the full one.

- Medusa (Medusa-1): head k at position t learns the token at t+k+2, weighted 0.8^k.
- EAGLE: the pair (x_{t+1}, f_t), noised, goes in; the guess of f_{t+1} learns f_{t+1} (smooth L1) and,
  through the LM head, the target's choice after t+1 (cross-entropy, weight 0.1), as in EAGLE.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import PretrainedConfig

from speculative.drafters.eagle import EagleModel, EagleShape
from speculative.drafters.medusa import MedusaHeads, ResBlock
from speculative.train.data import Corpus


@dataclass
class Fitted:
    """What a fit did: its loss per step, how long and over how much."""

    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    positions: int = 0  # training positions seen (with repeats)


@dataclass(frozen=True)
class Budget:
    """How long a fit runs, and its seed."""

    minutes: float = 10.0  # wall time; the fit stops at the first step past it
    max_steps: int | None = None  # or after this many steps (None: the minutes alone)
    seed: int = 0  # of torch's generator and the sampling of positions


@dataclass(frozen=True)
class MedusaFit:
    """Medusa's training knobs."""

    heads: int = 3  # head k predicts the token k + 2 ahead
    batch: int = 64  # positions per step
    lr: float = 1e-3


@dataclass(frozen=True)
class EagleFit:
    """EAGLE's training knobs."""

    window: int = 128  # positions of one sequence per step
    lr: float = 3e-4
    noise: float = 0.1  # uniform noise on the input features, times their spread


def _budget(budget: Budget, desc: str) -> tuple[Callable[[int], bool], tqdm]:
    """A step test that stops at `max_steps` or after `minutes`, and a progress bar over the minutes."""
    minutes, max_steps = budget.minutes, budget.max_steps
    start, limit = time.perf_counter(), minutes * 60
    bar = tqdm(total=round(limit), desc=desc, unit="s")

    def go(step: int) -> bool:
        bar.n = min(round(time.perf_counter() - start), bar.total)
        bar.refresh()
        return (max_steps is None or step < max_steps) and time.perf_counter() - start < limit

    return go, bar


def fit_medusa(
    corpus: Corpus,
    lm_head: torch.Tensor,  # [V, H] the target's LM head weight
    budget: Budget = Budget(),
    fit: MedusaFit = MedusaFit(),
) -> tuple[MedusaHeads, Fitted]:
    torch.manual_seed(budget.seed)
    rng = random.Random(budget.seed)
    heads, batch = fit.heads, fit.batch
    vocab, hidden = lm_head.shape
    module = MedusaHeads(hidden, vocab, heads)
    each = [cast(nn.Sequential, head) for head in module.medusa_head]
    with torch.no_grad():
        for head in each:
            block, projection = cast(ResBlock, head[0]), cast(nn.Linear, head[-1])
            block.linear.weight.zero_()  # each head starts as the target's own next-token head
            projection.weight.copy_(lm_head.float())
            projection.weight.requires_grad_(False)
    ids = corpus.vocabulary()
    sub = lm_head.float()[ids]  # [V', H]
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[ids] = torch.arange(len(ids))
    where = [(i, t) for i, s in enumerate(corpus.samples) for t in range(len(s.tokens) - heads - 1)]
    blocks = [p for head in each for p in head[:-1].parameters()]
    opt = torch.optim.AdamW(blocks, lr=fit.lr)
    fitted = Fitted()
    go, bar = _budget(budget, "medusa")
    start = time.perf_counter()
    while go(fitted.steps):
        picked = [where[rng.randrange(len(where))] for _ in range(batch)]
        h = torch.stack([corpus.samples[i].features[t] for i, t in picked]).float()  # [B, H]
        loss = torch.zeros(())
        for k, head in enumerate(each):
            labels = index[torch.tensor([int(corpus.samples[i].tokens[t + k + 2]) for i, t in picked])]
            loss = loss + 0.8**k * F.cross_entropy(head[:-1](h) @ sub.T, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        fitted.losses.append(float(loss))
        fitted.steps += 1
        fitted.positions += batch
        bar.set_postfix(loss=f"{_recent(fitted.losses):.3f}")
    bar.close()
    fitted.seconds = time.perf_counter() - start
    return module.eval(), fitted


def rope_theta(config: PretrainedConfig) -> float:
    """The config's RoPE base (transformers 5 keeps it in `rope_parameters`)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def eagle_shape(config: PretrainedConfig, intermediate: int | None = None) -> EagleShape:
    """An EAGLE head for a target of this config: its attention shape and RoPE, its MLP width unless
    `intermediate` (qkv biases for Qwen2 targets, as EAGLE's Qwen2 heads have)."""
    return EagleShape(
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        intermediate=intermediate or config.intermediate_size,
        vocab=config.vocab_size,
        eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta(config),
        qkv_bias=config.model_type == "qwen2",
    )


def fit_eagle(
    corpus: Corpus,
    embed: torch.Tensor,  # [V, H] the target's input embedding weight
    lm_head: torch.Tensor,  # [V, H] its LM head weight
    shape: EagleShape,
    budget: Budget = Budget(),
    fit: EagleFit = EagleFit(),
) -> tuple[EagleModel, Fitted]:
    torch.manual_seed(budget.seed)
    rng = random.Random(budget.seed)
    window, noise = fit.window, fit.noise
    model = EagleModel(shape).train()
    vocab = lm_head.shape[0]
    ids = corpus.vocabulary()
    sub = lm_head.float()[ids]  # [V', H]
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[ids] = torch.arange(len(ids))
    usable = [s for s in corpus.samples if len(s.tokens) >= 3]
    scale = torch.cat([s.features[:64].float() for s in usable]).std()  # the features' spread, for the noise
    opt = torch.optim.AdamW(model.parameters(), lr=fit.lr)
    fitted = Fitted()
    go, bar = _budget(budget, "eagle")
    start = time.perf_counter()
    while go(fitted.steps):
        s = usable[rng.randrange(len(usable))]
        pairs = len(s.tokens) - 2  # t = 0..n-3: (x_{t+1}, f_t) -> f_{t+1} and the choice after t+1
        lo = rng.randrange(max(pairs - window, 0) + 1)
        t = torch.arange(lo, min(lo + window, pairs))
        f = s.features[t].float()
        f = f + (torch.rand_like(f) * 2 - 1) * noise * scale
        guessed, _ = model(
            embed[s.tokens[t + 1]].float(),
            f,
            t,
            model.empty_cache(),
            torch.ones(len(t), len(t), dtype=torch.bool).tril(),
        )
        regression = F.smooth_l1_loss(guessed, s.features[t + 1].float())
        labels = index[s.choices[t + 1]]
        loss = regression + 0.1 * F.cross_entropy(guessed @ sub.T, labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        fitted.losses.append(float(loss))
        fitted.steps += 1
        fitted.positions += len(t)
        bar.set_postfix(loss=f"{_recent(fitted.losses):.3f}")
    bar.close()
    fitted.seconds = time.perf_counter() - start
    return model.eval(), fitted


def _recent(losses: list[float], n: int = 50) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail) if tail else math.nan
