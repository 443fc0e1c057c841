"""Medusa heads: extra prediction heads on the target's last hidden state, and the trees they propose.

Medusa-1 (FasterDecoding/Medusa): head k (0-based) reads the hidden state h_t that the target's LM
head turns into token t+1 and predicts token t+k+2, through `layers` residual blocks
(x + SiLU(W x + b)) and a vocabulary projection. So after a verify, the hidden state at the last
accepted node gives the bonus token (the LM head, in the verdict) and, through the heads, guesses
for the tokens after it: the next round's tree, rooted at the bonus, with no draft model and no
extra forward of the target (`MedusaTrees`, the `heads.TreeHeads` the verifier calls).

The tree is data built once (Medusa's `medusa_choices`): each choice is a path of top-k ranks, one
per depth, so (0,) is head 0's top token under the root and (0, 1) head 1's second token under it.
Every prefix of a choice is a choice too. Example, choices (0,), (1,), (0, 0), heads' top tokens
[[5, 9], [7, 3]]: root -> 5 -> 7, and root -> 9.

Checkpoints in the published layout: a folder with `config.json` (`medusa_num_heads`,
`medusa_num_layers`, `base_model_name_or_path`) and `medusa_lm_head.safetensors` (or `.pt`) holding
the `medusa_head` ModuleList's state dict: `{head}.{layer}.linear.weight|bias` for the residual
blocks and `{head}.{layers}.weight` for the projection.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from speculative.drafters.heads import HeadInput, read_state
from speculative.rules.tree import TokenTree

CONFIG = "config.json"
WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# A sparse default tree over 4 heads (15 nodes): wide where the heads are surest (depth 1), the top-1
# path to the last head, and second guesses under the likeliest nodes.
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
)  # fmt: skip


class ResBlock(nn.Module):
    """x + SiLU(linear(x)): the published Medusa block (its `linear` key name kept)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """`heads` heads of `layers` residual blocks and a vocabulary projection each."""

    def __init__(self, hidden: int, vocab: int, heads: int, layers: int = 1) -> None:
        super().__init__()
        self.hidden, self.vocab, self.layers = hidden, vocab, layers
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(heads)
        )

    @property
    def heads(self) -> int:
        return len(self.medusa_head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, K, V]
        return torch.stack([head(hidden) for head in self.medusa_head], dim=1)

    def top(self, hidden: torch.Tensor, k: int) -> torch.Tensor:  # [N, H] -> [N, K, k] token ids, best first
        return self(hidden).topk(k, dim=-1).indices


def save_medusa(heads: MedusaHeads, folder: str | Path, base_model: str = "") -> Path:
    """Write `heads` in the published layout (config.json + medusa_lm_head.safetensors)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "medusa_num_heads": heads.heads,
        "medusa_num_layers": heads.layers,
        "base_model_name_or_path": base_model,
        "hidden_size": heads.hidden,
        "vocab_size": heads.vocab,
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in heads.medusa_head.state_dict().items()}
    save_file(state, str(out / WEIGHTS[0]))
    return out


def load_medusa(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> MedusaHeads:
    """Heads from a folder in the published layout; sizes from the weights (the config may omit them)."""
    root = Path(folder)
    config = json.loads((root / CONFIG).read_text())
    state = {k.removeprefix("medusa_head."): v for k, v in read_state(root, WEIGHTS).items()}
    heads, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    vocab, hidden = state[f"0.{layers}.weight"].shape
    module = MedusaHeads(int(hidden), int(vocab), heads, layers)
    module.medusa_head.load_state_dict(state)
    return module.to(device=device, dtype=dtype).eval()


def check_choices(choices: Sequence[Sequence[int]], heads: int) -> tuple[tuple[int, ...], ...]:
    """The choices sorted parents first; ValueError if one is deeper than the heads or misses a prefix."""
    out = tuple(sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c)))
    for c in out:
        if not c or len(c) > heads or min(c) < 0:
            raise ValueError(f"medusa choice {c}: needs 1..{heads} ranks (one per head), each >= 0")
        if len(c) > 1 and c[:-1] not in out:
            raise ValueError(f"medusa choice {c}: its prefix {c[:-1]} is not a choice")
    return out


def choices_tree(root: int, top: list[list[int]], choices: Sequence[tuple[int, ...]], depth: int) -> TokenTree:
    """The tree of `choices` (sorted parents first) no deeper than `depth`; `top[d]`: head d's tokens,
    best first (siblings come from one head's distinct ranks, so their tokens differ). A choice deeper
    than the heads or ranked past `top` is left out, with its subtree."""
    node_of: dict[tuple[int, ...], int] = {(): 0}
    tokens: list[int] = []
    parents: list[int] = []
    for c in choices:
        if len(c) > min(depth, len(top)) or c[:-1] not in node_of or c[-1] >= len(top[len(c) - 1]):
            continue
        tokens.append(top[len(c) - 1][c[-1]])
        parents.append(node_of[c[:-1]])
        node_of[c] = len(tokens)
    return TokenTree(root, tuple(tokens), tuple(parents))


class MedusaTrees:
    """Medusa as `heads.TreeHeads`: after each verify, the heads read the hidden state the bonus token came
    from (the last one kept) and their `top` best tokens each fill the tree of `choices` (those no deeper
    than the heads). Stateless: a sequence needs nothing of its earlier rounds."""

    def __init__(self, heads: MedusaHeads, choices: Sequence[Sequence[int]], top: int = 4) -> None:
        self.heads, self.top = heads, top
        # sorted parents first, as `choices_tree` reads them; choices deeper than the heads are left out
        self.choices = check_choices([c for c in choices if len(c) <= heads.heads], heads.heads)
        self.dtype = next(heads.parameters()).dtype

    def advance(self, rows: list[HeadInput]) -> list[TokenTree | None]:
        ready = [k for k, r in enumerate(rows) if r.reaches_bonus]  # (else the bonus's state is not here)
        out: list[TokenTree | None] = [None] * len(rows)
        if not ready:
            return out
        last = torch.stack([rows[k].features[-1] for k in ready]).to(self.dtype)  # [N, H], one call for all
        with torch.no_grad():
            top = self.heads.top(last, self.top).tolist()  # [N][K][top]
        for k, guessed in zip(ready, top, strict=True):
            out[k] = choices_tree(rows[k].tokens[-1], guessed, self.choices, self.heads.heads)
        return out

    def release(self, seq_ids: list[str]) -> None:
        pass
