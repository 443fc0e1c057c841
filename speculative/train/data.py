"""Training data for heads: what the target itself writes and what it makes of text, position by position.

Two sources, both on this machine: the target's greedy answers to the prompts of `prompts.TRAIN`
(prompt and answer as one sequence, so the answer is exactly what the target outputs), and stretches
of Python's standard-library sources (text the target reads, not writes). For every position t of
every sequence the target's forward gives its last hidden state f_t (what its LM head reads; the
features EAGLE and Medusa heads read) and its own greedy choice for token t+1.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from speculative.engine.loading import LoadedModel, chat_ids


@dataclass(frozen=True)
class Sample:
    """One sequence with the target's view of it."""

    tokens: torch.Tensor  # [n] int64
    features: torch.Tensor  # [n, H] the target's last hidden state at each position (bfloat16)
    choices: torch.Tensor  # [n] int64: the target's greedy choice for the token after each position


@dataclass(frozen=True)
class Corpus:
    samples: list[Sample]
    answers: int  # sequences that are the target's own answers (the rest: standard-library text)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    def vocabulary(self) -> torch.Tensor:
        """Every token id in the corpus (its tokens and the target's choices), sorted: [V']."""
        return torch.cat([torch.cat([s.tokens, s.choices]) for s in self.samples]).unique()


@torch.no_grad()
def greedy_answers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], new_tokens: int, batch: int = 8
) -> list[list[int]]:
    """Each prompt (in the chat template) followed by the target's greedy answer, up to its end token."""
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = model.generation_config.eos_token_id
    stops = set([eos] if isinstance(eos, int) else eos or [])
    out: list[list[int]] = []
    for start in tqdm(range(0, len(encoded), batch), desc="greedy answers", unit="batch"):
        group = encoded[start : start + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(g)) + g for g in group])  # left padded
        mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
        generated = cast(Any, model).generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad
        )
        for g, row in zip(group, generated[:, width:].tolist(), strict=True):
            end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            out.append(g + row[:end])
    return out


def stdlib_text(tokenizer: PreTrainedTokenizerBase, tokens: int, window: int, seed: int = 0) -> list[list[int]]:
    """About `tokens` tokens of Python's standard-library sources, in windows of `window` tokens, from files
    drawn in a seeded order (the same corpus every run on the same Python)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    out: list[list[int]] = []
    total = 0
    for path in files:
        if total >= tokens:
            break
        ids = tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - window // 2, window):
            out.append(ids[start : start + window])
            total += len(out[-1])
            if total >= tokens:
                break
    return out


@torch.no_grad()
def observe(model: PreTrainedModel, sequences: list[list[int]]) -> list[Sample]:
    """The target's last hidden states and greedy choices over each sequence (one forward each)."""
    head = model.get_output_embeddings()
    samples = []
    for seq in tqdm(sequences, desc="target features", unit="seq"):
        ids = torch.tensor([seq])
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]  # [n, H]
        choices = head(hidden[None])[0].argmax(-1)  # [n]
        samples.append(Sample(ids[0], hidden.to(torch.bfloat16), choices))
    return samples


def build_corpus(
    loaded: LoadedModel,  # the target and its tokenizer
    prompts: list[str],
    answer_tokens: int,
    text_tokens: int,
    window: int = 256,
    seed: int = 0,
) -> Corpus:
    model, tokenizer = loaded.model, loaded.tokenizer
    answers = greedy_answers(model, tokenizer, prompts, answer_tokens)
    text = stdlib_text(tokenizer, text_tokens, window, seed) if text_tokens else []
    return Corpus(observe(model, answers + text), len(answers))
