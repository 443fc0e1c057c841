"""The model runner: one batched KV cache over a `transformers` causal LM, with speculation.

Each row of the batch is one sequence. The cache holds, per row, a committed prefix
(`lens[row]` tokens, left-aligned; shorter rows have masked holes up to the widest) followed by a
speculative region shared by all rows: tokens appended by `forward` since the last `commit`,
each attached to a parent (an earlier speculative column, or -1 for the committed end). The 4D
attention mask lets a token see its row's committed prefix and its own speculative ancestors, and
its position id is `lens[row] + depth`, so a whole tree, a chain, a prompt or a batch of all three
is one forward. `commit(keep)` moves the kept speculative columns (an accepted path) right after
the committed prefix and drops the rest: that is both commit and rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from speculative.packing import ATTENTION, PackedCache, Packing, row_offsets


@dataclass
class _Speculative:
    """Bookkeeping of the speculative region; S = number of speculative columns."""

    tokens: torch.Tensor  # [B, S] int64
    ancestors: torch.Tensor  # [B, S, S] bool, self included
    depths: torch.Tensor  # [B, S] int64; 0 = child of the committed end

    @staticmethod
    def empty(batch: int) -> _Speculative:
        return _Speculative(
            torch.zeros(batch, 0, dtype=torch.long),
            torch.zeros(batch, 0, 0, dtype=torch.bool),
            torch.zeros(batch, 0, dtype=torch.long),
        )


class ModelRunner:
    """Batched prefill, decode and tree verification with commit/rollback, for any HF causal LM."""

    def __init__(self, model: PreTrainedModel) -> None:
        """Sets the model's attention to `packing.ATTENTION` (SDPA, packed-aware; other callers of the
        model, e.g. `generate`, get plain SDPA through it)."""
        model.set_attn_implementation(ATTENTION)
        self.model = model.eval()
        self._base = model.base_model  # the transformer stack, without the LM head
        self._head = model.get_output_embeddings()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # model inputs go here; bookkeeping stays on CPU
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.rows: list[str] = []  # sequence id of each row
        self.lens = torch.zeros(0, dtype=torch.long)  # [B] committed tokens in cache
        self.cached: list[list[int]] = []  # committed token ids in cache, per row
        self.cache = PackedCache(config=model.config)
        self.spec = _Speculative.empty(0)

    # ---- rows -------------------------------------------------------------------------
    @property
    def width(self) -> int:
        """Columns of the committed region (the longest committed prefix)."""
        return int(self.lens.max()) if len(self.rows) else 0

    def row(self, seq_id: str) -> int:
        return self.rows.index(seq_id)

    def add_rows(self, seq_ids: list[str]) -> None:
        """New empty sequences at the end of the batch. Requires no pending speculation."""
        self._require_no_speculation("add_rows")
        duplicates = set(seq_ids) & set(self.rows) or len(set(seq_ids)) != len(seq_ids)
        if duplicates:
            raise ValueError(f"sequence ids already in the batch or repeated: {seq_ids}")
        n = len(seq_ids)
        for layer in self._layers():
            pad = lambda t: torch.cat([t, t.new_zeros(n, *t.shape[1:])], dim=0)  # noqa: E731
            layer.keys, layer.values = pad(layer.keys), pad(layer.values)
        self.rows += seq_ids
        self.lens = torch.cat([self.lens, torch.zeros(n, dtype=torch.long)])
        self.cached += [[] for _ in seq_ids]
        self.spec = _Speculative.empty(len(self.rows))

    def remove_rows(self, seq_ids: list[str]) -> None:
        """Drop sequences and their KV. Requires no pending speculation."""
        self._require_no_speculation("remove_rows")
        gone = {self.row(s) for s in seq_ids}
        keep = [i for i in range(len(self.rows)) if i not in gone]
        index = torch.tensor(keep, dtype=torch.long)  # bookkeeping stays on the CPU, KV on the model's device
        self.rows = [self.rows[i] for i in keep]
        self.lens = self.lens[index]
        self.cached = [self.cached[i] for i in keep]
        index = index.to(self.device)
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.spec = _Speculative.empty(len(self.rows))
        self._crop()

    def _layers(self) -> list[Any]:
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    def _require_no_speculation(self, what: str) -> None:
        if self.spec.tokens.shape[1]:
            raise RuntimeError(f"{what} while speculative tokens are pending; commit first")

    # ---- forward ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        tokens: list[list[int]],  # per row, the new tokens (rows may differ in length, may be empty)
        parents: list[list[int]],  # per row: -1 = committed end, j >= 0 = speculative column j
        logits_at: list[list[int]] | None = None,  # per row, indices into its new tokens
        on_device: bool = False,
    ) -> torch.Tensor | None:  # [B, m, V] logits at `logits_at` (m = most asked); pads garbage
        """Append tokens to the speculative region of every row and run one forward.

        Only the hidden states at `logits_at` go through the LM head (a prompt of 500 tokens and a
        vocabulary of 150k would otherwise be 300 MB of logits); None computes no logits. Logits come
        back as float32 on the CPU, or with `on_device` as the head computed them (model dtype, model
        device), for callers that reduce them there first. `forward_packed` returns them unpadded.
        """
        flat = self.forward_packed(tokens, parents, logits_at)  # [P, V]
        if flat is None or logits_at is None:
            return None
        batch, m = len(self.rows), max(max((len(a) for a in logits_at), default=0), 1)
        slots = [b * m + j for b, at in enumerate(logits_at) for j in range(len(at))]  # in the flat [B * m]
        if slots == list(range(batch * m)):  # every row asks m: the packed order is the padded one
            logits = flat.view(batch, m, -1)
        else:  # pads left unwritten: a [B * m, V] fill costs as much as a tenth of a 32-row decode step
            logits = flat.new_empty(batch * m, flat.shape[-1])
            logits[torch.tensor(slots, dtype=torch.long, device=self.device)] = flat
            logits = logits.view(batch, m, -1)
        return logits if on_device else logits.float().cpu()

    @torch.no_grad()
    def forward_packed(
        self,
        tokens: list[list[int]],  # per row, the new tokens (rows may differ in length, may be empty)
        parents: list[list[int]],  # per row: -1 = committed end, j >= 0 = speculative column j
        logits_at: list[list[int]] | None = None,  # per row, indices into its new tokens
    ) -> torch.Tensor | None:  # [P, V] logits at `logits_at`, row by row (model dtype, model device)
        """`forward`, with the logits as the head computed them: row by row, no padding (P = asked in
        all rows; row b's start at `packing.row_offsets` of the rows' asked counts)."""
        batch = len(self.rows)
        if len(tokens) != batch or len(parents) != batch:
            raise ValueError(f"expected {batch} rows of tokens and parents")
        n = max((len(t) for t in tokens), default=0)
        if n == 0:
            return None
        start = self.spec.tokens.shape[1]  # speculative columns before this call
        new_tokens = torch.zeros(batch, n, dtype=torch.long)
        new_parents = torch.full((batch, n), -1, dtype=torch.long)
        valid = torch.zeros(batch, n, dtype=torch.bool)
        for b, (toks, pars) in enumerate(zip(tokens, parents, strict=True)):
            if len(toks) != len(pars):
                raise ValueError(f"row {b}: {len(toks)} tokens but {len(pars)} parents")
            new_tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            new_parents[b, : len(pars)] = torch.tensor(pars, dtype=torch.long)
            valid[b, : len(toks)] = True
        if bool(((new_parents >= start + torch.arange(n)) & valid).any()):
            raise ValueError("a token's parent must be an earlier column")
        self._extend_speculation(new_tokens, new_parents)
        mask = self._attention_mask(start, n)  # [B, 1, n, width + S]
        positions = self.lens[:, None] + self.spec.depths[:, start:]  # [B, n]
        lengths = [len(t) for t in tokens]
        hidden = self._run(lengths, new_tokens[valid], positions[valid], mask)  # [T, H], T = sum(lengths)
        if logits_at is None:
            return None
        offsets = row_offsets(lengths)
        asked = [min(a + offsets[b], len(hidden) - 1) for b, at in enumerate(logits_at) for a in at]  # packed
        picked = hidden[torch.tensor(asked, dtype=torch.long, device=self.device)]  # [P, H]
        return self._head(picked[None])[0]  # [P, V] (a batch dimension: DeepSpeed's sharded head wants one)

    def _run(
        self,
        lengths: list[int],  # [B] new tokens per row
        tokens: torch.Tensor,  # [T] the rows' new tokens, row by row
        positions: torch.Tensor,  # [T] their position ids
        mask: torch.Tensor,  # [B, 1, n, C + n]
    ) -> torch.Tensor:  # [T, H]
        """The transformer stack over the rows' new tokens as one packed row (`packing`: no padding)."""
        dev = self.device
        pack = Packing.of(lengths, mask, dev)
        self.cache.packing = pack
        try:
            out = self._base(
                input_ids=tokens[None].to(dev),
                position_ids=positions[None].to(dev),
                attention_mask=pack.mask,
                cache=self.cache,
                use_cache=True,
            )
        finally:
            self.cache.packing = None
        return out.last_hidden_state[0]

    def _extend_speculation(self, new_tokens: torch.Tensor, new_parents: torch.Tensor) -> None:
        batch, n = new_tokens.shape
        start = self.spec.tokens.shape[1]
        total = start + n
        anc = torch.zeros(batch, total, total, dtype=torch.bool)
        anc[:, :start, :start] = self.spec.ancestors
        depths = torch.cat([self.spec.depths, torch.zeros(batch, n, dtype=torch.long)], dim=1)
        rows = torch.arange(batch)
        for t in range(n):
            col = start + t
            par = new_parents[:, t]  # [B]
            has_parent = par >= 0
            par_c = par.clamp_min(0)
            anc[:, col] = anc[rows, par_c] & has_parent[:, None]
            anc[:, col, col] = True
            depths[:, col] = torch.where(has_parent, depths[rows, par_c] + 1, 0)
        self.spec = _Speculative(torch.cat([self.spec.tokens, new_tokens], dim=1), anc, depths)

    def _attention_mask(self, start: int, n: int) -> torch.Tensor:  # [B, 1, n, width + S]
        batch, width = len(self.rows), self.width
        committed = torch.arange(width)[None, None, :] < self.lens[:, None, None]  # [B, 1, width]
        committed = committed.expand(batch, n, width)
        speculative = self.spec.ancestors[:, start:, :]  # [B, n, S]
        allowed = torch.cat([committed, speculative], dim=2)[:, None]  # [B, 1, n, width + S]
        zero = torch.zeros((), dtype=self.dtype)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    # ---- commit -----------------------------------------------------------------------
    def commit(self, keep: list[list[int]]) -> None:
        """Per row, keep these speculative columns (an ancestor path, root first); drop the rest."""
        if len(keep) != len(self.rows):
            raise ValueError(f"expected {len(self.rows)} rows of kept columns")
        width, n_spec = self.width, self.spec.tokens.shape[1]
        rows, src, dst = [], [], []
        for b, cols in enumerate(keep):
            if any(not 0 <= c < n_spec for c in cols):
                raise ValueError(f"row {b}: kept column out of range 0..{n_spec - 1}: {cols}")
            base = int(self.lens[b])
            rows += [b] * len(cols)
            src += [width + c for c in cols]
            dst += list(range(base, base + len(cols)))
            self.cached[b] += self.spec.tokens[b, cols].tolist()
            self.lens[b] += len(cols)
        if rows:
            r, s, d = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (rows, src, dst))
            for layer in self._layers():
                layer.keys[r, :, d] = layer.keys[r, :, s]
                layer.values[r, :, d] = layer.values[r, :, s]
        self.spec = _Speculative.empty(len(self.rows))
        self._crop()

    def _crop(self) -> None:
        """Cut the cache to the committed region: the mask assumes it is exactly `width` wide."""
        width = self.width
        for layer in self._layers():
            layer.keys = layer.keys[:, :, :width]
            layer.values = layer.values[:, :, :width]

    def rollback(self) -> None:
        """Drop all speculative columns."""
        self.commit([[] for _ in self.rows])

    def truncate(self, row: int, length: int) -> None:
        """Forget committed tokens of a row past `length` (their KV becomes a masked hole)."""
        self._require_no_speculation("truncate")
        length = min(length, int(self.lens[row]))
        self.lens[row] = length
        del self.cached[row][length:]
        self._crop()

    def sync(self, rows: list[int], sequences: list[list[int]]) -> list[list[int]]:
        """Make these rows' committed caches prefixes of their sequences, all but the last token.

        Rows whose cache went past or away from their sequence are cut back to the longest common
        prefix. Returns, per given row, the tokens still missing from the cache (never empty).
        """
        missing = []
        for b, seq in zip(rows, sequences, strict=True):
            if not seq:
                raise ValueError(f"row {b}: empty sequence")
            cached, limit = self.cached[b], len(seq) - 1
            common = 0
            for have, want in zip(cached[:limit], seq[:limit], strict=False):
                if have != want:
                    break
                common += 1
            if common < len(cached):
                self.truncate(b, common)
            missing.append(list(seq[common:]))
        return missing

    # ---- convenience ------------------------------------------------------------------
    def extend(self, tokens: list[list[int]]) -> None:
        """Append each row's tokens as a chain and commit them all (prefill / catch-up)."""
        self._require_no_speculation("extend")
        self.forward(tokens, [chain_parents(len(t)) for t in tokens])
        self.commit([list(range(len(t))) for t in tokens])


def chain_parents(n: int, start: int = 0, first_parent: int = -1) -> list[int]:
    """Runner parents of n tokens appended as a chain at speculative columns start..start+n-1."""
    return [first_parent, *range(start, start + n - 1)][:n]
