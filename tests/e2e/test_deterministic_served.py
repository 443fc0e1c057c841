"""The same tokens in bfloat16, served: `deploy/local.yaml` as shipped (bfloat16 where the CPU computes it
natively, the target on its GGUF tensors where the CPU runs their kernel (`target_weights: auto`),
`target_pool.deterministic: auto`, drafting round ahead with two alternatives per pre-draft, the int4 draft,
64-token prefill chunks) gives, request by request through the `openai` client, plain decoding's tokens:
those of the in-process decoder without drafts on the 12 prompts of `test_deterministic_bf16` on the same
weights (`test_stored_weights`'s 64 tokens where they are stored, else the bfloat16 test's 128), and those
of the same server with `max_draft_tokens: 0`.

Without batch-invariant target forwards a verify rounds unlike a one-token step, and such outputs part.
"""

from __future__ import annotations

import openai
import pytest
from ray import serve

from deploy.app import build_app
from deploy.config import AppConfig
from speculative.engine.cpu import kquant
from speculative.engine.loading import resolve_dtype
from tests.actors.serve_helpers import deploy_yaml, free_port, local_ray, run_app
from tests.e2e import test_deterministic_bf16, test_stored_weights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(resolve_dtype("auto", "cpu") != "bfloat16", reason="this CPU has no native bfloat16"),
]


def test_local_yaml_in_bfloat16_drafting_round_ahead_gives_plain_decodings_tokens() -> None:
    (application,) = deploy_yaml("local.yaml", {})["applications"]
    config = AppConfig.model_validate(application["args"])
    stored = config.target_weights == "auto" and kquant.library() is not None
    reference = test_stored_weights if stored else test_deterministic_bf16
    prompts, expected = reference.plain_outputs()
    new_tokens = reference.NEW_TOKENS
    reference.release_models()  # the replicas below load their own copies
    assert config.router().round_ahead and config.router().ahead_alternatives, "round ahead with alternatives"
    port = free_port()
    with local_ray(num_cpus=4):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        handle = run_app(build_app(config), route_prefix="/", timeout_s=900)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        name = str(config.front_door.served_model_name if config.front_door else config.target_model)

        def served(prompt: list[int], speculate: bool) -> list[int]:
            extra = {"return_token_ids": True} | ({} if speculate else {"max_draft_tokens": 0})
            done = client.completions.create(
                model=name, prompt=prompt, max_tokens=new_tokens, temperature=0.0, extra_body=extra
            )
            return list(done.choices[0].model_extra["token_ids"])

        got = [served(p, speculate=True) for p in prompts]  # one at a time: c = 1, round ahead
        assert served(prompts[1], speculate=False) == expected[1], "the server's plain decoding is the decoder's"
        stats = handle.stats.remote().result()
    differ = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not differ, f"prompts {differ} part from plain decoding"
    assert stats["predraft_sequences"] > len(prompts), "pre-drafts beyond the prefill rounds"
