"""EAGLE (SafeAILab/EAGLE, EAGLE-2): a one-layer head drafting from the target's own features.

The target's last hidden state f_t (what its LM head reads) at position t, paired with the token
x_{t+1} that came next, goes in as fc([embed(x_{t+1}); f_t]); one decoder layer with its own KV cache
over the sequence turns it into a guess of f_{t+1}, and the target's LM head turns that into the
distribution of x_{t+2}. Drafting goes on from guessed features: node y under a node whose guessed
feature is g goes in as (y, g). The embedding and the LM head are the target's own (frozen, shared).

The tree is EAGLE-2's dynamic tree: each node scores the sum of the draft's log-probabilities along
its path; at every depth the `top_k` best-scored nodes are expanded, each by its `top_k` likeliest
tokens, and the tree is the `nodes` best-scored nodes of all (`confidence_tree`, a pure function of
the log-probabilities). Example, top_k 2, nodes 3: root children a (-0.1), b (-2.3); a expanded to
c (-0.2 total), d (-3.0), b to e (-2.5), f (-4.0): the tree is a, c, b.

Checkpoints in the published layout (EAGLE-1/2): a folder with `config.json` (a Llama config:
hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps, rope_theta,
vocab_size, num_hidden_layers; `qkv_bias` for Qwen2 targets, `bias` for fc) and
`pytorch_model.bin` (or `model.safetensors`) with `fc.weight|bias`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight` (q/k/v `.bias` with qkv_bias),
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.post_attention_layernorm.weight`,
`layers.{i}.input_layernorm.weight` for i > 0 (layer 0 reads fc's output as it is) and optionally
`embed_tokens.weight` (a copy of the target's, not used: the target's own is).

Runs on the target replica (`TargetConfig.heads`): the features never leave it, and the head shares
the target's embedding and LM head in memory, where a draft pool would need copies of both and the
features of every accepted token shipped to it; the price is that drafting adds to the verify call.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speculative.drafters.heads import HeadInput, read_state
from speculative.rules.tree import TokenTree

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class EagleShape:
    """The head's sizes, as its config.json gives them."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    layers: int = 1
    eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    fc_bias: bool = True

    @staticmethod
    def from_config(config: dict) -> EagleShape:
        return EagleShape(
            hidden=int(config["hidden_size"]),
            heads=int(config["num_attention_heads"]),
            kv_heads=int(config.get("num_key_value_heads", config["num_attention_heads"])),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            layers=int(config.get("num_hidden_layers", 1)),
            eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            qkv_bias=bool(config.get("qkv_bias", False)),
            fc_bias=bool(config.get("bias", True)),
        )

    def config(self, base_model: str = "") -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "num_hidden_layers": self.layers,
            "rms_norm_eps": self.eps,
            "rope_theta": self.rope_theta,
            "qkv_bias": self.qkv_bias,
            "bias": self.fc_bias,
            "base_model_name_or_path": base_model,
        }


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    """Llama attention (grouped KV heads, rotary positions) over a cache given by the caller."""

    inv_freq: torch.Tensor  # [d/2] the rotary frequencies (a buffer)

    def __init__(self, shape: EagleShape) -> None:
        super().__init__()
        self.shape, self.dim = shape, shape.hidden // shape.heads
        h, d = shape.hidden, self.dim
        self.q_proj = nn.Linear(h, shape.heads * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(h, shape.kv_heads * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(h, shape.kv_heads * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.heads * d, h, bias=False)
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [h, n, d]
        angles = positions.float()[:, None] * self.inv_freq[None]  # [n, d/2]
        cos, sin = (torch.cat([a, a], -1).to(x.dtype) for a in (angles.cos(), angles.sin()))  # [n, d]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def forward(
        self,
        x: torch.Tensor,  # [n, H]
        positions: torch.Tensor,  # [n]
        past: tuple[torch.Tensor, torch.Tensor],  # keys, values [kv_heads, m, d]
        mask: torch.Tensor,  # [n, m + n] bool, True: attends
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # [n, H], this call's keys and values
        n, s, d = len(x), self.shape, self.dim
        q = self._rotate(self.q_proj(x).view(n, s.heads, d).transpose(0, 1), positions)  # [heads, n, d]
        k = self._rotate(self.k_proj(x).view(n, s.kv_heads, d).transpose(0, 1), positions)  # [kv, n, d]
        v = self.v_proj(x).view(n, s.kv_heads, d).transpose(0, 1)
        keys, values = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)  # [kv, m + n, d]
        groups = s.heads // s.kv_heads
        out = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0), attn_mask=mask[None]
        )  # [heads, n, d]
        return self.o_proj(out.transpose(0, 1).reshape(n, s.heads * d)), (k, v)


class MLP(nn.Module):
    def __init__(self, shape: EagleShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """A Llama decoder layer; the first has no input norm (it reads fc's output as it is), as in EAGLE."""

    def __init__(self, shape: EagleShape, index: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(shape), MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps) if index else None
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        normed = self.input_layernorm(x) if self.input_layernorm is not None else x
        attended, kv = self.self_attn(normed, positions, past, mask)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class EagleModel(nn.Module):
    """The checkpoint's modules: fc over [embedding; feature] and the decoder layers."""

    def __init__(self, shape: EagleShape) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(2 * shape.hidden, shape.hidden, bias=shape.fc_bias)
        self.layers = nn.ModuleList(Layer(shape, i) for i in range(shape.layers))

    def forward(
        self,
        embeds: torch.Tensor,  # [n, H] the tokens x_{t+1}, embedded by the target
        features: torch.Tensor,  # [n, H] the (target's or guessed) features f_t
        positions: torch.Tensor,  # [n] t
        past: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, keys and values [kv_heads, m, d]
        mask: torch.Tensor,  # [n, m + n] bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:  # [n, H] guesses of f_{t+1}, new KV
        x = self.fc(torch.cat([embeds, features], -1))
        new = []
        for layer, kv in zip(self.layers, past, strict=True):
            x, added = layer(x, positions, kv, mask)
            new.append(added)
        return x, new

    def empty_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s, p = self.shape, next(self.parameters())
        empty = torch.empty(s.kv_heads, 0, s.hidden // s.heads, dtype=p.dtype, device=p.device)
        return [(empty, empty) for _ in self.layers]


def save_eagle(model: EagleModel, folder: str | Path, base_model: str = "") -> Path:
    """Write `model` in the published layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(model.shape.config(base_model), indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / WEIGHTS[0]))
    return out


def load_eagle(folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> EagleModel:
    """A head from a folder in the published layout (a copy of the target's embedding in it is ignored)."""
    root = Path(folder)
    shape = EagleShape.from_config(json.loads((root / CONFIG).read_text()))
    state = {k: v for k, v in read_state(root, WEIGHTS).items() if not k.startswith("embed_tokens.")}
    model = EagleModel(shape)
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


# expand(frontier, tokens, parents) -> [F, V] log-probs of the children of the frontier's candidates
Expand = Callable[[list[int], list[int], list[int]], torch.Tensor]


def confidence_tree(root: int, first: torch.Tensor, expand: Expand, top_k: int, depth: int, nodes: int) -> TokenTree:
    """EAGLE-2's dynamic tree (the module docstring): `first` [V] the log-probs of the root's children;
    `expand` those of the children of the candidates given (by index into the candidates' tokens and
    parents, parent -1 the root). The `top_k` best candidates of each depth are expanded, `depth` levels
    in all, and the `nodes` best of all candidates make the tree (ties: the shallower, then the earlier)."""
    c = _Candidates()
    best = first.float().topk(min(top_k, len(first)))
    frontier = c.add(best.values.tolist(), best.indices.tolist(), [-1] * len(best.indices))
    for _ in range(depth - 1):
        logp = expand(frontier, c.tokens, c.parents).float()  # [F, V]
        base = torch.tensor([c.scores[i] for i in frontier])[:, None]
        top = (logp + base).topk(min(top_k, logp.shape[1]), dim=-1)  # [F, k] per frontier candidate
        parents = [i for i in frontier for _ in range(top.indices.shape[1])]
        new = c.add(top.values.flatten().tolist(), top.indices.flatten().tolist(), parents)
        frontier = sorted(new, key=lambda i: (-c.scores[i], i))[:top_k]
    order = sorted(range(len(c.tokens)), key=lambda i: (-c.scores[i], c.depths[i], i))[:nodes]
    chosen = set(order)
    kept = sorted((i for i in order if _rooted(i, c.parents, chosen)), key=lambda i: (c.depths[i], i))
    index = {-1: 0, **{i: n + 1 for n, i in enumerate(kept)}}
    return TokenTree(root, tuple(c.tokens[i] for i in kept), tuple(index[c.parents[i]] for i in kept))


@dataclass
class _Candidates:
    """The dynamic tree's candidates so far, one row per candidate across the four lists."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # candidate index of each candidate's parent, -1 the root
    scores: list[float] = field(default_factory=list)  # sum of the draft's log-probs along the path
    depths: list[int] = field(default_factory=list)  # the root's children 1

    def add(self, scores: list[float], tokens: list[int], parents: list[int]) -> list[int]:
        """Append candidates (none with a -inf score: a token the draft rules out); their indices."""
        added = []
        for score, token, parent in zip(scores, tokens, parents, strict=True):
            if math.isinf(score):
                continue
            added.append(len(self.tokens))
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.scores.append(float(score))
            self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        return added


def _rooted(c: int, parents: list[int], chosen: set[int]) -> bool:
    while c >= 0:
        if c not in chosen:
            return False
        c = parents[c]
    return True


@dataclass
class _Cache:
    """One sequence's head cache: per layer, keys and values [kv_heads, length, d] of pairs (x_{t+1}, f_t)
    for t < length."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return int(self.kv[0][0].shape[1])

    def truncate(self, length: int) -> None:
        self.kv = [(k[:, :length], v[:, :length]) for k, v in self.kv]


class EagleTrees:
    """EAGLE as `heads.TreeHeads`: each sequence's head cache follows the target's (the features of every
    position it keeps), and after each verify the head drafts the next round's dynamic tree."""

    def __init__(
        self,
        model: EagleModel,
        embed: nn.Module,  # the target's input embedding
        head: Callable[[torch.Tensor], torch.Tensor],  # [n, H] -> [n, V] the target's LM head
        top_k: int = 4,
        depth: int = 5,
        nodes: int = 16,
    ) -> None:
        self.model, self.embed, self.head = model, embed, head
        self.top_k, self.depth, self.nodes = top_k, depth, nodes
        self.dtype = next(model.parameters()).dtype
        self.caches: dict[str, _Cache] = {}

    def advance(self, rows: list[HeadInput]) -> list[TokenTree | None]:
        """Each sequence in turn (its own cache and tree search)."""
        return [self._advance(r) for r in rows]

    @torch.no_grad()
    def _advance(self, row: HeadInput) -> TokenTree | None:
        seq_id, tokens, start, features = row.seq_id, row.tokens, row.start, row.features
        cache = self.caches.get(seq_id)
        if cache is None or cache.length < start:  # (features before `start` never seen: begin again at 0)
            if start:
                self.caches.pop(seq_id, None)
                return None
            cache = self.caches[seq_id] = _Cache(self.model.empty_cache())
        cache.truncate(start)  # the target's cache was cut back to `start` (a rollback): so is this one
        n = len(features)
        if not n:
            return None
        if start + n > len(tokens) - 1:
            raise ValueError(f"{seq_id}: features up to position {start + n - 1} but only {len(tokens)} tokens")
        dev = features.device
        nxt = torch.tensor(tokens[start + 1 : start + n + 1], device=dev)  # [n] x_{t+1}
        positions = torch.arange(start, start + n, device=dev)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=dev).tril(start)  # causal over the cache
        out, kv = self.model(self._embed(nxt), features.to(self.dtype), positions, cache.kv, mask)
        cache.kv = [
            (torch.cat([k0, k], 1), torch.cat([v0, v], 1)) for (k0, v0), (k, v) in zip(cache.kv, kv, strict=True)
        ]
        if not row.reaches_bonus:  # drafting needs the pair of the bonus token
            return None
        return self._tree(cache, out[-1], tokens[-1], start + n - 1)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids[None])[0].to(self.dtype)

    def _log_probs(self, guessed: torch.Tensor) -> torch.Tensor:  # [F, H] -> [F, V]
        return torch.log_softmax(self.head(guessed).float(), -1)

    def _tree(self, cache: _Cache, last: torch.Tensor, root: int, at: int) -> TokenTree:
        """The dynamic tree after the pair at position `at` (the bonus token's), whose guessed feature is
        `last`: frontier candidates go through the layer as (token, their parent's guessed feature) at
        position at + depth, attending to the cache and their own ancestors."""
        guessed: dict[int, torch.Tensor] = {-1: last}  # candidate -> the feature guessed at its position
        fed: list[int] = []  # candidates in the draft's temporary cache, in column order
        added: list[tuple[torch.Tensor, torch.Tensor]] = [(k[:, :0], v[:, :0]) for k, v in cache.kv]
        length = cache.length

        def expand(frontier: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            nonlocal added
            column = {c: i for i, c in enumerate(fed)}
            dev = last.device
            ids = torch.tensor([tokens[c] for c in frontier], device=dev)
            feats = torch.stack([guessed[parents[c]] for c in frontier])  # [F, H]
            depth = [_depth(c, parents) for c in frontier]
            positions = torch.tensor([at + d for d in depth], device=dev)
            width = length + len(fed) + len(frontier)
            mask = torch.zeros(len(frontier), width, dtype=torch.bool, device=dev)
            mask[:, :length] = True
            for row, c in enumerate(frontier):
                mask[row, length + len(fed) + row] = True
                p = parents[c]
                while p >= 0:
                    mask[row, length + column[p]] = True
                    p = parents[p]
            past = [
                (torch.cat([k0, k], 1), torch.cat([v0, v], 1)) for (k0, v0), (k, v) in zip(cache.kv, added, strict=True)
            ]
            out, kv = self.model(self._embed(ids), feats, positions, past, mask)
            added = [(torch.cat([k0, k], 1), torch.cat([v0, v], 1)) for (k0, v0), (k, v) in zip(added, kv, strict=True)]
            fed.extend(frontier)
            guessed.update(zip(frontier, out, strict=True))
            return self._log_probs(out)

        first = self._log_probs(last[None])[0]
        return confidence_tree(root, first, expand, self.top_k, self.depth, self.nodes)

    def release(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.caches.pop(s, None)


def _depth(c: int, parents: list[int]) -> int:
    d = 0
    while c >= 0:
        d, c = d + 1, parents[c]
    return d
