"""Adaptive speculation depth, prompt lookup, and token-tree construction."""

from __future__ import annotations

import pytest
import torch

from speculative.drafters.base import DraftRequest
from speculative.drafters.lookup import PromptLookupDrafter, lookup_continuation, lookup_match, run_class
from speculative.planning.depth import Acceptance, DepthConfig, best_depth, depth_cap, expected_tokens, own_depth
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree


def test_expected_tokens_formula():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 3) == 4.0


def test_best_depth_grows_with_acceptance_and_vanishes_when_drafts_fail():
    config = DepthConfig(max_depth=8, draft_cost=0.3, verify_overhead=0.1)
    depths = [best_depth(a, config) for a in (0.05, 0.3, 0.6, 0.9, 0.99)]
    assert depths[0] == 0  # drafting a token that is never accepted only costs
    assert depths == sorted(depths) and depths[-1] >= 6
    assert best_depth(0.99, config.model_copy(update={"draft_cost": 0.0})) == 8  # free drafts: max


def test_sequence_depth_follows_its_acceptance_and_probes_back():
    config = DepthConfig(max_depth=6, probe_every=3)
    evidence, since = Acceptance(), 0  # rounds since the sequence last drafted
    for _ in range(10):
        k = own_depth(evidence, since, config)
        evidence.update(k, 0, config.memory)  # every draft rejected
        since = 0 if k else since + 1
    probes = []
    for _ in range(8):
        k = own_depth(evidence, since, config)
        probes.append(k)
        since = 0 if k else since + 1
    assert probes.count(1) == 2 and probes.count(0) == 6  # at k = 0, a k = 1 probe after 3 rounds without drafts
    for _ in range(12):
        k = max(own_depth(evidence, 0, config), 1)
        evidence.update(k, k, config.memory)  # everything accepted
    assert own_depth(evidence, 0, config) == 6


def test_disabled_adaptation_always_drafts_max_depth():
    evidence = Acceptance()
    evidence.update(5, 0, 0.8)
    assert own_depth(evidence, 0, DepthConfig(max_depth=5, adaptive=False)) == 5


def test_depth_cap_shrinks_with_batch_and_queue():
    config = DepthConfig(verify_token_budget=16, max_depth=4)
    assert [depth_cap(config, n, 0) for n in (1, 4, 16)] == [4, 3, 0]  # 16 tokens shared by the batch
    assert depth_cap(config, 1, 2) == 1  # halved per queued verify call
    assert depth_cap(config.model_copy(update={"shrink_when_queued": False}), 1, 2) == 4


def test_lookup_copies_continuation_of_latest_longest_match():
    seq = torch.tensor([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup_continuation(seq, max_ngram=3, min_ngram=1, length=3) == [7, 8, 5]  # "2 3" last seen before 7
    assert lookup_continuation(torch.tensor([4, 5, 6]), 3, 1, 3) == []
    assert lookup_continuation(torch.tensor([4, 4]), 3, 1, 3) == [4]


def test_lookup_match_says_how_long_a_suffix_matched():
    seq = torch.tensor([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup_match(seq, max_ngram=3, min_ngram=1, length=3) == (2, [7, 8, 5])
    assert lookup_match(seq, max_ngram=1, min_ngram=1, length=2) == (2, [7, 8])  # "3" last seen before 7;
    # its run goes on into "2 3", the n-gram a longer max_ngram would have matched
    assert lookup_match(torch.tensor([4, 5, 6]), 3, 1, 3) == (0, [])
    drafter = PromptLookupDrafter(max_ngram=3)
    assert drafter.match((1, 2, 3, 4, 5, 1, 2, 3), 4) == (2, 4)  # "1 2 3" (run class 2) then 4 5 1 2
    assert drafter.match((1, 2, 3, 4, 1, 2, 3), 8) == (2, 4)  # only 4 tokens follow the match
    assert drafter.match((1, 2, 3), 4) == (0, 0)


def test_lookup_match_prefers_the_occurrence_quoted_longest() -> None:
    """Of two earlier occurrences of the suffix, the draft follows the one whose context agrees longest
    with the sequence's end, and says how long that run is: the prompt being quoted, not the latest
    chance repeat of its last tokens."""
    prompt = [7, 1, 2, 3, 4, 5, 0, 0, 9]
    tokens = torch.tensor([*prompt, 3, 4, 5, 1, 1, *prompt[:6]])  # the output quotes 7 1 2 3 4 5
    assert lookup_match(tokens, max_ngram=3, min_ngram=1, length=3) == (6, [0, 0, 9])
    assert lookup_match(tokens[:-3], 3, 1, 2) == (3, [3, 4])  # "7 1 2": one occurrence, a run of 3
    assert [run_class(r) for r in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [0, 1, 2, 2, 4, 4, 8, 8, 16]


def test_lookup_drafter_respects_budget_and_proposes_a_chain():
    drafter = PromptLookupDrafter(max_ngram=2)
    params = SamplingParams(temperature=0.0)
    req = DraftRequest("s", (1, 2, 3, 4, 1, 2), budget=2, params=params)
    (prop,) = drafter.propose([req])
    assert prop.tree.root == 2 and prop.tree.tokens == (3, 4) and prop.tree.parents == (0, 1)
    (none,) = drafter.propose([DraftRequest("s", (1, 2, 3), budget=0, params=params)])
    assert none.tree.size == 0
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_lookup_drafts_a_prediction_the_context_lacks_and_prefers_the_longer_quote() -> None:
    drafter = PromptLookupDrafter(max_ngram=3)
    predicted = SamplingParams(temperature=0.0, prediction=(7, 8, 9, 10, 11, 12))
    tokens = (1, 2, 3, 7, 8, 9)  # the output has begun repeating the prediction
    (prop,) = drafter.propose([DraftRequest("s", tokens, budget=3, params=predicted)])
    assert prop.tree.tokens == (10, 11, 12)  # drafted from the prediction: the context alone has no match
    assert drafter.match(tokens, 3, predicted.prediction) == (run_class(3), 3)
    assert drafter.match(tokens, 3) == (0, 0)
    (bare,) = drafter.propose([DraftRequest("s", tokens, budget=3, params=SamplingParams(temperature=0.0))])
    assert bare.tree.size == 0
    # The prediction follows the prompt: an output whose first token begins it matches it with the prompt's end.
    started = (1, 2, 3, 7)  # prompt (1, 2, 3), then the prediction's first token
    assert drafter.match(started, 3, predicted.prediction, prompt_len=3) == (run_class(4), 3)
    assert drafter.match(started, 3, predicted.prediction) == (run_class(1), 3)  # the token alone, no prompt
    (first,) = drafter.propose([DraftRequest("s", started, budget=3, params=predicted, prompt_len=3)])
    assert first.tree.tokens == (8, 9, 10)
    # At the prediction's end the draft stops: what lookup searches next is the sequence, not what follows it.
    ending = (1, 2, 3, 7, 8, 9, 10, 11)
    (last,) = drafter.propose([DraftRequest("s", ending, budget=3, params=predicted, prompt_len=3)])
    assert last.tree.tokens == (12,)


def test_tree_structure_and_validation():
    tree = TokenTree(9, (10, 11, 12, 13), (0, 0, 1, 1))
    assert tree.children == ((1, 2), (3, 4), (), (), ())
    assert tree.depths == (0, 1, 1, 2, 2)
    assert tree.path_tokens(4) == [10, 13]
    assert tree.runner_parents() == [-1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="precede"):
        TokenTree(9, (10, 11), (0, 2))
    with pytest.raises(ValueError, match="two children"):
        TokenTree(9, (10, 10), (0, 0))
    assert TokenTree.chain(1, [2, 3]).parents == (0, 1)
