"""The model runner: one batched KV cache over a `transformers` causal LM, with speculation.

Each row of the batch is one sequence. The cache (`kv_cache.SlotCache`, slot b = row b) holds, per
row, a committed prefix (`lens[row]` tokens) followed by that row's speculative region: tokens
appended by `forward` since the last `commit`, each attached to a parent (an earlier speculative
column, or -1 for the committed end). Speculative column j is shared by all rows' bookkeeping
(rows adding fewer tokens leave pads) and sits at cache column lens[row] + j. The 4D attention
mask lets a token see its row's committed prefix and its own speculative ancestors, and its
position id is `lens[row] + depth`, so a whole tree, a chain, a prompt or a batch of all three is
one forward. `commit(keep)` moves the kept speculative columns (an accepted path) right after the
committed prefix and forgets the rest: that is both commit and rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from speculative.engine import packing
from speculative.engine.kv_cache import Shape, SlotCache, Write, bucketed
from speculative.engine.kv_pool import KvPool
from speculative.engine.lean_stack import lean_stack
from speculative.engine.packing import ATTENTION, Packing, row_offsets

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class _Speculative:
    """Bookkeeping of the speculative region; S = number of speculative columns. NumPy on the host:
    its small per-step operations cost a microsecond each there, several times less than as tensors."""

    tokens: np.ndarray  # [B, S] int64
    ancestors: np.ndarray  # [B, S, S] bool, self included
    depths: np.ndarray  # [B, S] int64; 0 = child of the committed end

    @staticmethod
    def empty(batch: int) -> _Speculative:
        return _Speculative(
            np.zeros((batch, 0), dtype=np.int64),
            np.zeros((batch, 0, 0), dtype=bool),
            np.zeros((batch, 0), dtype=np.int64),
        )


@dataclass(frozen=True)
class Step:
    """One forward's new tokens in the runner's [B, n] layout (rows adding fewer tokens leave pads)."""

    tokens: np.ndarray  # [B, n] int64, pads 0
    positions: np.ndarray  # [B, n] int64 position ids
    valid: np.ndarray  # [B, n] bool: a row's own token, not a pad
    lengths: list[int]  # [B] new tokens per row
    start: int  # speculative columns before this forward

    def cells(self, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [T] rows, [T] cache columns
        """The cache slot and column of each new token, packed row by row."""
        batch, n = self.tokens.shape
        columns = lens[:, None] + self.start + np.arange(n)  # [B, n]
        rows = np.broadcast_to(np.arange(batch)[:, None], (batch, n))  # [B, n]
        return rows[self.valid], columns[self.valid]


class ModelRunner:
    """Batched prefill, decode and tree verification with commit/rollback, for any HF causal LM."""

    def __init__(
        self,
        model: PreTrainedModel,
        reserve: Shape | None = None,
        lean: bool = False,
        pool: KvPool | None = None,
    ) -> None:
        """Sets the model's attention to `packing.ATTENTION` (SDPA, packed-aware; other callers of the
        model, e.g. `generate`, get plain SDPA through it). `reserve`: (rows, columns) the KV cache is
        made with at the first forward (`kv_cache.preallocated`), where `pool` has room; None: it grows as
        needed. `lean`: run the stack as `lean_stack` does where it knows the architecture (the same hidden
        states, fewer calls: a draft model's forwards of a few tokens). `pool`: the process's KV pool the
        cache draws its buffers from (`kv_pool`); None: unbounded."""
        packing.register()
        model.set_attn_implementation(ATTENTION)
        self.model = model.eval()
        self._base = model.base_model  # the transformer stack, without the LM head
        self._lean = lean_stack(self._base) if lean else None
        self._head = model.get_output_embeddings()
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device  # model inputs go here; bookkeeping stays on CPU
        self.vocab_size = int(self._head.weight.shape[0])
        self.rows: list[str] = []  # sequence id of each row
        self.lens = np.zeros(0, dtype=np.int64)  # [B] committed tokens in cache
        self.cached: list[list[int]] = []  # committed token ids in cache, per row
        self.cache = SlotCache(model.config)
        self.pool = pool
        if pool is not None:
            pool.join(self)
        if reserve is not None:
            self.cache.resize(*self._granted([reserve, (0, 0)]))
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
        self._room(len(self.rows) + n, 0)  # slots for them, the columns as they are
        self.rows += seq_ids
        self.lens = np.concatenate([self.lens, np.zeros(n, dtype=np.int64)])
        self.cached += [[] for _ in seq_ids]
        self.spec = _Speculative.empty(len(self.rows))

    def reserve(self, columns: int) -> None:
        """Room for every row to reach `columns` tokens (committed + speculative) without the cache
        growing: a joining prompt's length, known at its first forward, costs one growth, not one
        per doubling while its chunks are prefilled."""
        self._room(len(self.rows), bucketed(columns))

    def _room(self, rows: int, cols: int) -> None:
        """The cache holds `rows` x `cols`: grown at least double where the pool has room, else to exactly that
        and what the rows use (slots and columns they left behind are not kept)."""
        if not self.cache.holds(rows, cols):
            used_rows, used_cols = self._in_use()
            least = max(rows, used_rows), max(bucketed(cols), used_cols)
            self.cache.resize(*self._granted([self.cache.doubled(rows, cols), least]))

    def _granted(self, shapes: list[Shape]) -> Shape:
        """The first of `shapes` the pool grants (`KvPool.take`); without a pool, the first."""
        return shapes[0] if self.pool is None else self.pool.take(self, shapes)

    def kv_bytes(self) -> int:
        """Bytes of the cells the pool granted this runner's cache (its buffers are made at that shape)."""
        return self.cache.cells() * (self.pool.token_bytes if self.pool is not None else 0)

    def trim(self) -> None:
        """Shrink the cache to the rows and columns its sequences use now, speculative ones included (the
        pool reclaiming room for another runner's forward; never during this runner's own)."""
        rows, cols = self._in_use()
        if rows < self.cache.slots or cols < self.cache.capacity:
            self.cache.resize(rows, cols)  # no rows: no buffers

    def _in_use(self) -> Shape:
        """The rows and (bucketed) columns the sequences' KV fills, speculative columns included."""
        return len(self.rows), bucketed(self.width + self.spec.tokens.shape[1])

    def remove_rows(self, seq_ids: list[str]) -> None:
        """Drop sequences and their KV. Requires no pending speculation.

        The last rows move into the holes below the new batch size (one slot's KV copied per hole,
        the other rows stay where they are), so rows 0..B-1 stay the attended slots. Row order changes;
        callers look rows up by sequence id.
        """
        self._require_no_speculation("remove_rows")
        gone = {self.row(s) for s in seq_ids}
        count = len(self.rows) - len(gone)
        holes = sorted(i for i in gone if i < count)
        movers = [i for i in range(count, len(self.rows)) if i not in gone]
        order = list(range(count))  # order[i]: the old row that becomes row i
        for hole, mover in zip(holes, movers, strict=True):
            self.cache.move_row(mover, hole, int(self.lens[mover]))
            order[hole] = mover
        self.rows = [self.rows[i] for i in order]
        self.lens = self.lens[order]
        self.cached = [self.cached[i] for i in order]
        self.spec = _Speculative.empty(len(self.rows))

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
    ) -> torch.Tensor | None:  # [P, V] logits at `logits_at`, row by row (model dtype, model device)
        """Append tokens to the speculative region of every row and run one forward.

        Only the hidden states at `logits_at` go through the LM head (a prompt of 500 tokens and a
        vocabulary of 150k would otherwise be 300 MB of logits); None computes no logits. Logits come
        back as the head computed them, row by row with no padding: P = asked in all rows, row b's
        first at `packing.row_offsets` of the rows' asked counts.
        """
        picked = self.forward_hidden(tokens, parents, logits_at)
        return None if picked is None else self.logits(picked)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [P, H] -> [P, V]
        return self._head(hidden[None])[0]  # a batch dimension: DeepSpeed's sharded head wants one

    @torch.no_grad()
    def forward_hidden(
        self, tokens: list[list[int]], parents: list[list[int]], logits_at: list[list[int]] | None = None
    ) -> torch.Tensor | None:  # [P, H] the last hidden states at `logits_at` (what `forward` gives the head)
        """`forward` without the LM head: the hidden states it would project (extra heads read them too)."""
        batch = len(self.rows)
        if len(tokens) != batch or len(parents) != batch:
            raise ValueError(f"expected {batch} rows of tokens and parents")
        n = max((len(t) for t in tokens), default=0)
        if n == 0:
            return None
        start = self.spec.tokens.shape[1]  # speculative columns before this call
        lengths = [len(t) for t in tokens]
        if any(len(p) != len(t) for t, p in zip(tokens, parents, strict=True)):
            bad = next(b for b, (t, p) in enumerate(zip(tokens, parents, strict=True)) if len(p) != len(t))
            raise ValueError(f"row {bad}: {len(tokens[bad])} tokens but {len(parents[bad])} parents")
        valid = np.arange(n)[None, :] < np.array(lengths)[:, None]  # [B, n]
        new_tokens = np.zeros((batch, n), dtype=np.int64)
        new_tokens[valid] = [t for row in tokens for t in row]
        new_parents = np.full((batch, n), -1, dtype=np.int64)
        new_parents[valid] = [p for row in parents for p in row]
        if ((new_parents >= start + np.arange(n)) & valid).any():
            raise ValueError("a token's parent must be an earlier column")
        self._extend_speculation(new_tokens, new_parents)
        positions = self.lens[:, None] + self.spec.depths[:, start:]  # [B, n]
        hidden = self._execute(Step(new_tokens, positions, valid, lengths, start))  # [T, H], T = sum(lengths)
        if logits_at is None:
            return None
        offsets = row_offsets(lengths)
        asked = [min(a + offsets[b], len(hidden) - 1) for b, at in enumerate(logits_at) for a in at]  # packed
        return hidden[torch.tensor(asked, dtype=torch.long, device=self.device)]  # [P, H]

    def _execute(self, step: Step) -> torch.Tensor:  # [T, H] the rows' new tokens' hidden states, packed
        """One forward of `step` over the cache as it grows: attention over the bucketed width in use."""
        batch, n = step.tokens.shape
        width = bucketed(self.width + step.start + n)  # attended columns: every row's committed + speculative
        self._room(batch, width)
        mask = self._attention_mask(step.start, n, width)  # [B, 1, n, width]
        rows, columns = step.cells(self.lens)
        index = self.cache.index(torch.from_numpy(rows), torch.from_numpy(columns))  # [T]
        write = Write(index.to(self.device), batch, width)
        packed_tokens = torch.from_numpy(step.tokens[step.valid])  # [T]
        packed_positions = torch.from_numpy(step.positions[step.valid])  # [T]
        return self._run(step.lengths, packed_tokens, packed_positions, mask, write)

    def _run(
        self,
        lengths: list[int],  # [B] new tokens per row
        tokens: torch.Tensor,  # [T] the rows' new tokens, row by row
        positions: torch.Tensor,  # [T] their position ids
        mask: torch.Tensor,  # [B, 1, n, width]
        write: Write,  # where their keys and values go in the cache
    ) -> torch.Tensor:  # [T, H]
        """The transformer stack over the rows' new tokens as one packed row (`packing`: no padding)."""
        dev = self.device
        pack = Packing.of(lengths, mask, dev)
        self.cache.write = write
        try:
            if self._lean is not None:
                return self._lean(tokens.to(dev), positions.to(dev), pack.mask, self.cache)
            out = self._base(
                input_ids=tokens[None].to(dev),
                position_ids=positions[None].to(dev),
                attention_mask=pack.mask,
                cache=self.cache,
                use_cache=True,
            )
        finally:
            self.cache.write = None
        return out.last_hidden_state[0]

    def _extend_speculation(self, new_tokens: np.ndarray, new_parents: np.ndarray) -> None:  # [B, n] each
        batch, n = new_tokens.shape
        start = self.spec.tokens.shape[1]
        total = start + n
        anc = np.zeros((batch, total, total), dtype=bool)
        anc[:, :start, :start] = self.spec.ancestors
        depths = np.concatenate([self.spec.depths, np.zeros((batch, n), dtype=np.int64)], axis=1)
        rows = np.arange(batch)
        for t in range(n):
            col = start + t
            par = new_parents[:, t]  # [B]
            has_parent = par >= 0
            par_c = np.maximum(par, 0)
            anc[:, col] = anc[rows, par_c] & has_parent[:, None]
            anc[:, col, col] = True
            depths[:, col] = np.where(has_parent, depths[rows, par_c] + 1, 0)
        self.spec = _Speculative(np.concatenate([self.spec.tokens, new_tokens], axis=1), anc, depths)

    def _attention_mask(self, start: int, n: int, width: int) -> torch.Tensor:  # [B, 1, n, width]
        """Row b's query i sees cache columns < lens[b] and lens[b] + j for its speculative ancestors j."""
        total = self.spec.tokens.shape[1]
        spec_col = np.arange(width)[None, :] - self.lens[:, None]  # [B, width]: speculative column, < 0 committed
        in_spec = (spec_col >= 0) & (spec_col < total)  # [B, width]
        index = np.clip(spec_col, 0, total - 1)[:, None, :]  # [B, 1, width]
        ancestor = np.take_along_axis(self.spec.ancestors[:, start:, :], index, axis=2) & in_spec[:, None, :]
        allowed = torch.from_numpy((spec_col < 0)[:, None, :] | ancestor)  # [B, n, width]
        zero = torch.zeros((), dtype=self.dtype)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)[:, None]

    # ---- commit -----------------------------------------------------------------------
    def commit(self, keep: list[list[int]]) -> None:
        """Per row, keep these speculative columns (an ancestor path, root first); drop the rest."""
        if len(keep) != len(self.rows):
            raise ValueError(f"expected {len(self.rows)} rows of kept columns")
        n_spec = self.spec.tokens.shape[1]
        spec_tokens = self.spec.tokens.tolist()  # [B][S]
        lens = self.lens.tolist()
        rows, src, dst = [], [], []
        for b, cols in enumerate(keep):
            if any(not 0 <= c < n_spec for c in cols):
                raise ValueError(f"row {b}: kept column out of range 0..{n_spec - 1}: {cols}")
            moved = [(c, i) for i, c in enumerate(cols) if c != i]  # a chain's accepted prefix stays put
            rows += [b] * len(moved)
            src += [lens[b] + c for c, _ in moved]
            dst += [lens[b] + i for _, i in moved]
            self.cached[b] += [spec_tokens[b][c] for c in cols]
        self.lens += np.array([len(cols) for cols in keep], dtype=np.int64)
        if rows:
            r, s, d = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (rows, src, dst))
            self.cache.move_columns(r, s, d)
        self.spec = _Speculative.empty(len(self.rows))

    def truncate(self, row: int, length: int) -> None:
        """Forget committed tokens of a row past `length` (their KV becomes a masked hole)."""
        self._require_no_speculation("truncate")
        length = min(length, int(self.lens[row]))
        self.lens[row] = length
        del self.cached[row][length:]

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
            common = len(cached)
            if common > limit or cached != seq[:common]:  # went past or away from the sequence
                common = 0
                for have, want in zip(cached[:limit], seq[:limit], strict=False):
                    if have != want:
                        break
                    common += 1
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
