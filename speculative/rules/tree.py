"""Token trees: what a drafter proposes and the target verifies in one forward.

Node 0 is the root: the last committed token, whose KV the target has not computed yet. Nodes
1..n are draft tokens, each with a parent of smaller index (so a node's ancestors come before it).
A chain of k tokens is a tree of width 1. Built once per step as data (Medusa's tree buffers),
then read by the target verifier (`all_tokens` and `runner_parents` become the runner's input
tokens and parents, from which the runner builds its attention mask and positions) and by the
acceptance rules (children).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenTree:
    """A draft tree over one sequence; the root token is the sequence's last committed token."""

    root: int
    tokens: tuple[int, ...]  # draft token of node i+1
    parents: tuple[int, ...]  # parent node of node i+1, in 0..i
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # per node 0..n, in draft order
    depths: tuple[int, ...] = field(init=False, repr=False)  # per node 0..n; root 0

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        children: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        depths = [0]
        for i, parent in enumerate(self.parents):
            node = i + 1
            if not 0 <= parent < node:
                raise ValueError(f"node {node} has parent {parent}; parents must precede their children")
            if any(self.tokens[c - 1] == self.tokens[i] for c in children[parent]):
                raise ValueError(f"node {parent} has two children with token {self.tokens[i]}")
            children[parent].append(node)
            depths.append(depths[parent] + 1)
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "depths", tuple(depths))

    @staticmethod
    def chain(root: int, tokens: list[int] | tuple[int, ...]) -> TokenTree:
        return TokenTree(root, tuple(tokens), tuple(range(len(tokens))))

    @property
    def size(self) -> int:
        """Number of draft nodes (the root excluded)."""
        return len(self.tokens)

    @property
    def all_tokens(self) -> tuple[int, ...]:
        """Root then draft tokens: the runner's input for this tree, node order."""
        return (self.root, *self.tokens)

    def token(self, node: int) -> int:
        return self.root if node == 0 else self.tokens[node - 1]

    def path_tokens(self, node: int) -> list[int]:
        """Draft tokens from the root (excluded) down to `node` (included)."""
        out: list[int] = []
        while node != 0:
            out.append(self.tokens[node - 1])
            node = self.parents[node - 1]
        return out[::-1]

    def runner_parents(self) -> list[int]:
        """Parents in the runner's convention: -1 for the root, else the node index."""
        return [-1, *self.parents]
