"""What the router's metrics record for a verified step: vLLM's spec_decode counters (draft rounds,
0-based positions) beside specserve's own (1-based depths), and the per-sequence counts behind them."""

from __future__ import annotations

import pytest

from actors.metrics import RouterMetrics
from actors.records import Live
from speculative.planning.sequence import Sequence
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from tests.ray_metrics import FakeRayMetrics, fake_ray_metrics


@pytest.fixture
def ray_metrics(monkeypatch: pytest.MonkeyPatch) -> FakeRayMetrics:
    return fake_ray_metrics(monkeypatch)


def sequence() -> Sequence:
    return Sequence("s", [5, 6], SamplingParams(max_tokens=8))


def test_a_step_counts_vllm_drafts_and_0_based_positions_beside_1_based_depths(ray_metrics: FakeRayMetrics) -> None:
    metrics, made = RouterMetrics(), ray_metrics.made
    # root -> a -> b -> c plus a sibling of b: four draft nodes at depths 1, 2, 2, 3; the path a, b accepted
    tree = TokenTree(1, (10, 11, 12, 13), (0, 1, 1, 2))
    metrics.step(tree.depths, 2, 3, now=1.0, live=Live(sequence()))
    metrics.step(TokenTree.chain(7, []).depths, 0, 1, now=2.0, live=Live(sequence()))  # a bare root: no draft
    assert made["spec_decode_num_drafts"].total == 1
    assert made["spec_decode_num_draft_tokens"].total == 4
    assert made["spec_decode_num_accepted_tokens"].total == 2
    assert made["spec_decode_num_accepted_tokens_per_pos"].by("position") == {"0": 1, "1": 1}
    assert made["specserve_accepted_tokens_total"].by("position") == {"1": 1, "2": 1}
    assert made["specserve_draft_tokens_total"].by("position") == {"1": 1, "2": 2, "3": 1}
    assert made["specserve_generated_tokens_total"].total == 4


def test_sequence_stats_count_draft_rounds_as_vllm_does() -> None:
    seq = sequence()
    seq.commit(TokenTree.chain(6, []), (7,), 0, frozenset(), None)  # prefill: no draft
    seq.commit(TokenTree.chain(7, [8, 9]), (8, 9, 3), 2, frozenset(), None)
    seq.commit(TokenTree.chain(3, [4]), (5,), 0, frozenset(), None)
    assert (seq.stats.steps, seq.stats.drafts, seq.stats.drafted, seq.stats.accepted) == (3, 2, 3, 2)
    assert 1 + seq.stats.accepted / seq.stats.drafts == 2.0  # vLLM's; per target step (ours) it is 5 / 3
    assert seq.stats.acceptance_length == 5 / 3


def test_a_pre_draft_that_drafted_for_no_sequence_counts_nothing(ray_metrics: FakeRayMetrics) -> None:
    """A catch-up call drafts nothing: late or settled, it is no pre-draft outcome (and Ray's
    counters fail the caller on an increment of 0, which would end the lane's requests)."""
    metrics, made = RouterMetrics(), ray_metrics.made
    metrics.ahead(0, 0, "late")
    metrics.ahead(0, 0, "settled", unverified=1)
    metrics.ahead(2, 1, "late")
    assert made["specserve_predraft_sequences_total"].by("outcome") == {"late": 2}
    assert made["specserve_draft_tokens_unverified_total"].total == 1


def test_a_request_ends_once_on_the_metrics(ray_metrics: FakeRayMetrics) -> None:
    """A lane fails a request (error), then its stream ends at the router (which counts a client gone): one end,
    the first, under specserve's finish_reason and vLLM's finished_reason; a client gone is vLLM's abort."""
    metrics, made = RouterMetrics("m"), ray_metrics.made
    failed, left = Live(sequence(), admitted=0.0), Live(sequence(), admitted=0.0)
    metrics.finished(failed, "error", 1.0)
    metrics.finished(failed, "cancelled", 2.0)
    metrics.finished(left, "cancelled", 3.0)
    assert made["specserve_requests_total"].by("finish_reason") == {"error": 1, "cancelled": 1}
    assert made["vllm_request_success"].by("finished_reason") == {"error": 1, "abort": 1}
    assert made["vllm_e2e_request_latency_seconds"].total == 1.0 + 3.0
    assert "vllm_request_prefill_time_seconds" not in {n for n, r in made.items() if r.total}  # never prefilled
    assert made["specserve_acceptance_length"].total == 0  # no whole request to measure
