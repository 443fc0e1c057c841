"""The device-side round (issue 47, line 2): with `TargetVerifier(device_round=True)` every row's acceptance
is walked where the logits are (`rules.walk`), and a verify round reads the device back once: counted by
`engine.syncs.SyncCounter` (.item(), .tolist(), .cpu(), .numpy(), nonzero-like ops) over whole rounds on the
captured runner's static-shape path, run uncompiled so the counter sees inside the forward too. Greedy,
target-sample matching and rejection rows, with penalties, mixed in one batch, give the host walk's tokens.
"""

from __future__ import annotations

import pytest

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.config import drafter_config
from speculative.engine.captured import Buckets, CapturedRunner
from speculative.engine.syncs import SyncCounter
from speculative.planning.depth import DepthConfig
from speculative.rules.proposal import Proposal
from speculative.rules.sampling import SamplingParams
from speculative.rules.tree import TokenTree
from speculative.target import TargetVerifier, VerifyItem
from tests.tiny_models import VOCAB, noisy_copy, reference_greedy, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12], [20, 21, 22, 23, 20, 21, 22], [7]]
DRAFTERS = {
    "chain": drafter_config(kind="model"),  # greedy draft; sampled requests: rejection (q sampled)
    "tree": drafter_config(kind="model", tree_width=3, tree_nodes=12),
    "topk": drafter_config(kind="model", tree_width=3, tree_nodes=12, sampled=False),  # target-sample matching
    "lookup": drafter_config(kind="lookup"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
MIXED = [
    SamplingParams(temperature=0.0, max_tokens=20),
    SamplingParams(temperature=0.9, top_k=20, max_tokens=20, seed=3),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=20),
    SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, max_tokens=20, seed=11),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    target = tiny_model(request.param)
    return target, noisy_copy(target, noise=0.2)


def decode(pair, drafter: str, params: list[SamplingParams], device_round: bool) -> tuple[list[list[int]], list[int]]:
    """Outputs of the prompts decoded together, and each verify round's device read-backs."""
    target, draft = pair
    runner = CapturedRunner(
        target, rows=4, columns=128, buckets=Buckets((1, 2, 4), (1, 2, 4, 8, 16)), compiler=lambda f: f
    )
    verifier = TargetVerifier(runner, device_round=device_round)
    syncs: list[int] = []
    verify = verifier.verify

    def counted(items):
        with SyncCounter() as counter:
            verdicts = verify(items)
        syncs.append(counter.count)
        return verdicts

    verifier.verify = counted  # type: ignore[method-assign]
    dec = SpeculativeDecoder(verifier, DRAFTERS[drafter].build(draft, VOCAB), DepthConfig(max_depth=4))
    return [s.output for s in dec.generate(PROMPTS, params)], syncs


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_a_round_reads_the_device_back_once(pair, drafter):
    outputs, syncs = decode(pair, drafter, MIXED, device_round=True)
    assert max(syncs) == 1, f"read-backs per round: {syncs}"
    greedy = reference_greedy(pair[0], PROMPTS[0], 20)
    assert outputs[0] == greedy


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_the_device_walk_gives_the_host_walks_tokens(pair, drafter):
    device, _ = decode(pair, drafter, MIXED, device_round=True)
    host, host_syncs = decode(pair, drafter, MIXED, device_round=False)
    assert device == host
    assert max(host_syncs) > 1, "the host walk reads argmaxes and distributions back apart"


def test_rejection_rows_alone_give_the_host_walks_tokens(pair):
    """Sampled requests on a sampled chain (rejection at every node), several seeds."""
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in (1, 2, 3, 4)]
    device, syncs = decode(pair, "chain", params, device_round=True)
    assert device == decode(pair, "chain", params, device_round=False)[0]
    assert max(syncs) == 1


def test_a_row_without_mass_fails_alone_on_the_same_read_back(pair):
    """A sampled row whose distributions have no mass (a repetition penalty of 1e-300 makes its logits infinite):
    its verdict carries the error, as on the host walk; the other rows' verdicts are the host walk's; still one
    read-back."""
    target, _ = pair
    doomed = SamplingParams.model_construct(  # past the front door's bound (>= 0.01): what a shard may still meet
        **(SamplingParams(temperature=1.0, seed=1, max_tokens=4).model_dump() | {"repetition_penalty": 1e-300})
    )
    fine = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=4)
    tree = TokenTree(9, (10, 11, 12), (0, 0, 1))
    items = [
        VerifyItem("a", (5, 6, 7, 9), fine, Proposal(tree)),
        VerifyItem("b", (5, 6, 7, 9), doomed, Proposal(tree)),
        VerifyItem("c", (11, 12, 9), GREEDY, Proposal(tree)),
    ]
    verdicts = {}
    for device_round in (True, False):
        runner = CapturedRunner(target, 4, 128, Buckets((1, 2, 4), (1, 2, 4, 8)), compiler=lambda f: f)
        verifier = TargetVerifier(runner, device_round=device_round)
        with SyncCounter() as syncs:
            verdicts[device_round] = verifier.verify(items)
        assert not device_round or syncs.count == 1
    for on_device, on_host in zip(verdicts[True], verdicts[False], strict=True):
        assert (on_device.error is None) == (on_host.error is None)
        assert on_device.tokens == on_host.tokens
    assert "no mass" in (verdicts[True][1].error or "") and verdicts[True][0].tokens
