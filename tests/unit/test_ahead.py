"""Pre-drafts with a spine (speculative/planning/ahead.py): the tree a draft model makes round ahead, and the
proposal a verdict takes from it.

A branch of a pre-draft must be exactly the draft a fresh drafter makes from the prefix the verdict
committed (greedy, fp32), whether the verdict took the whole assumed path or cut it.
"""

from __future__ import annotations

import pytest
import torch

from speculative.drafters.base import DraftRequest, Proposal
from speculative.drafters.hybrid import HybridDrafter
from speculative.drafters.lookup import PromptLookupDrafter
from speculative.drafters.model import DraftModelDrafter
from speculative.engine.runner import ModelRunner
from speculative.planning.ahead import ahead_request, take_ahead
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from tests.tiny_models import VOCAB, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def drafter(arch: str = "qwen2") -> DraftModelDrafter:
    return DraftModelDrafter(ModelRunner(tiny_model(arch, seed=3)), VOCAB)


def fresh_chain(arch: str, tokens: list[int], budget: int) -> list[int]:
    """What a drafter that never saw the sequence drafts from `tokens`."""
    (p,) = drafter(arch).propose([DraftRequest("fresh", tuple(tokens), budget, GREEDY)])
    return list(p.tree.tokens)


def walk(tree: TokenTree, tokens: list[int] | tuple[int, ...]) -> list[int]:
    """The nodes along `tokens` from the root (root included)."""
    nodes = [0]
    for t in tokens:
        nodes.append(next(c for c in tree.children[nodes[-1]] if tree.tokens[c - 1] == t))
    return nodes


def prompt(seed: int, n: int = 20) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_branch_of_a_pre_draft_is_the_draft_made_from_its_prefix(arch: str) -> None:
    committed = prompt(1)
    d = drafter(arch)
    (round_n,) = d.propose([DraftRequest("s", tuple(committed), 4, GREEDY)])  # round N's chain
    spine = list(round_n.tree.tokens)
    request = ahead_request(DraftRequest("s", tuple(committed), 3, GREEDY), round_n.tree, alternatives=2)
    assert request.spine == 4 and request.committed == tuple(committed)
    (pre,) = d.propose([request])
    tree = pre.tree
    assert tree.root == committed[-1], "rooted at the last committed token"
    on_spine = walk(tree, spine)  # the spine is a path from the root
    # The guess of the bonus at the spine's end, and two alternatives at spine nodes, each heading a chain of 3.
    heads = [(depth, c) for depth, node in enumerate(on_spine) for c in tree.children[node] if c not in on_spine]
    assert len(heads) == 3 and tree.size == 4 + 3 * (1 + 3)
    branches = 0
    for parent, head in heads:
        token = tree.tokens[head - 1]
        verdict = (*spine[:parent], token)  # the verdict that accepted `parent` drafts, then `token`
        taken = take_ahead(pre, verdict)
        assert taken is not None and taken.tree.root == token
        assert list(taken.tree.tokens) == fresh_chain(arch, [*committed, *verdict], 3)
        branches += parent < 4
    assert branches == 2, "two heads are alternatives where the spine is cut"


def test_a_pre_draft_with_no_spine_guesses_the_bonus_among_its_alternatives() -> None:
    """Beside a verify of no draft (a sequence's second round, its prompt caught up on) there is no spine: the
    alternatives are more guesses of that verify's token, the draft's next most likely, each heading the
    chain a fresh drafter makes from it."""
    committed = prompt(5)
    bare = TokenTree.chain(committed[-1], [])
    request = ahead_request(DraftRequest("s", tuple(committed), 3, GREEDY), bare, alternatives=2)
    assert request.spine == 0 and request.pre_draft
    (pre,) = drafter().propose([request])
    guesses = [pre.tree.tokens[c - 1] for c in pre.tree.children[0]]
    scores = drafter().runner.model(torch.tensor([committed])).logits[0, -1, :VOCAB]
    assert guesses == torch.topk(scores, 3).indices.tolist(), "the draft's three most likely first tokens"
    assert pre.tree.size == 3 * (1 + 3)
    for token in guesses:
        taken = take_ahead(pre, (token,))
        assert taken is not None and list(taken.tree.tokens) == fresh_chain("qwen2", [*committed, token], 3)


@pytest.mark.parametrize("alternatives", [0, 1])
def test_the_drafter_keeps_the_guessed_path_for_the_next_round(alternatives: int) -> None:
    """After a hit on the guess, the next pre-draft's catch-up is only the new tokens: the kept KV is the
    guess chain's, and its drafts are still the fresh drafter's. With no alternatives (nothing scored along
    the spine) the spine's kept KV serves too: the first forward is the spine's last token alone."""
    committed = prompt(2)
    d = drafter()
    (round_n,) = d.propose([DraftRequest("s", tuple(committed), 3, GREEDY)])
    (pre,) = d.propose(
        [ahead_request(DraftRequest("s", tuple(committed), 3, GREEDY), round_n.tree, alternatives=alternatives)]
    )
    end = walk(pre.tree, round_n.tree.tokens)[-1]
    guess = pre.tree.tokens[pre.tree.children[end][0] - 1]
    verdict = (*round_n.tree.tokens, guess)
    taken = take_ahead(pre, verdict)
    assert taken is not None
    now = [*committed, *verdict]
    widths: list[int] = []
    forward = d.runner.forward
    d.runner.forward = lambda tokens, *a, **k: widths.append(sum(map(len, tokens))) or forward(tokens, *a, **k)
    (pre2,) = d.propose(
        [ahead_request(DraftRequest("s", tuple(now), 2, GREEDY), taken.tree, alternatives=alternatives)]
    )
    end2 = walk(pre2.tree, taken.tree.tokens)[-1]
    guess2 = pre2.tree.tokens[pre2.tree.children[end2][0] - 1]
    assumed = [*now, *taken.tree.tokens]
    assert [guess2] == fresh_chain("qwen2", assumed, 1)
    taken2 = take_ahead(pre2, (*taken.tree.tokens, guess2))
    assert taken2 is not None and list(taken2.tree.tokens) == fresh_chain("qwen2", [*assumed, guess2], 2)
    spine = len(taken.tree.tokens)
    assert widths[0] == (1 if alternatives == 0 else 1 + spine), "the spine's end, plus the spine when scored"


def test_take_ahead_follows_the_verdict_from_the_root() -> None:
    #  7 -> 3 -> 9 -> 5 -> 2      (spine 3, 9; guess 5)
    #       3 -> 4 -> 6           (alternative 4 under 3)
    tree = TokenTree(7, (3, 9, 4, 5, 6, 2), (0, 1, 1, 2, 3, 4))
    pre = Proposal(tree)
    hit = take_ahead(pre, (3, 9, 5))
    assert hit is not None and (hit.tree.root, hit.tree.tokens) == (5, (2,))
    cut = take_ahead(pre, (3, 4))
    assert cut is not None and (cut.tree.root, cut.tree.tokens) == (4, (6,))
    assert take_ahead(pre, (8,)) is None, "cut where no branch was drafted"
    assert take_ahead(pre, (3, 9, 1)) is None, "a bonus the guess missed"
    assert take_ahead(pre, (3, 9, 5, 2)) is None, "a leaf: nothing drafted under it"
    assert take_ahead(Proposal(tree, torch.zeros(7, VOCAB)), (3, 9, 5)) is None, "sampled drafts are not taken"


def test_lookup_drafts_behind_the_spine() -> None:
    """Drafters that do not branch on a spine draft from all the tokens, their tree put under the spine."""
    tokens = (5, 6, 7, 8, 9, 5, 6)  # "5 6" recurs: lookup continues with 7 8 9
    request = DraftRequest("s", tokens, 3, GREEDY, spine=2)
    (p,) = PromptLookupDrafter(2, 1).propose([request])
    assert p.tree.root == 9 and p.tree.tokens == (5, 6, 7, 8, 9)
    assert take_ahead(p, (5, 6, 7)) is not None
    # the hybrid counts what lookup drafted beyond the spine
    (h,) = HybridDrafter(PromptLookupDrafter(2, 2), drafter()).propose([request])
    assert h.tree == p.tree


def test_a_pre_draft_stops_growing_at_its_deadline() -> None:
    """A pre-draft hides behind the verify: past `deadline_s` it drafts no deeper (the round would wait for
    it), but what it holds is the same draft, cut shorter."""
    committed = prompt(4)
    d = drafter()
    (round_n,) = d.propose([DraftRequest("s", tuple(committed), 3, GREEDY)])
    spine = list(round_n.tree.tokens)
    whole = d.propose([ahead_request(DraftRequest("s", tuple(committed), 4, GREEDY), round_n.tree, alternatives=1)])[
        0
    ].tree
    cut = d.propose([ahead_request(DraftRequest("s", tuple(committed), 4, GREEDY, 1), round_n.tree, deadline_s=0.0)])[
        0
    ].tree
    end = walk(whole, spine)[-1]
    assert max(whole.depths) == len(spine) + 5, "no deadline: the guess and 4 levels under it"
    assert max(cut.depths) == len(spine) + 2, "deadline spent: the guess and the one level a hit needs"
    guess = whole.tokens[whole.children[end][0] - 1]
    assert cut.tokens[cut.children[walk(cut, spine)[-1]][0] - 1] == guess
