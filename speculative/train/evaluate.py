"""How well trained heads draft for the target: acceptance length on prompts they were not trained on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from speculative.decoder import SpeculativeDecoder
from speculative.drafters.heads import TreeDrafter, TreeHeads
from speculative.engine.loading import LoadedModel, chat_ids
from speculative.engine.runner import ModelRunner
from speculative.planning.depth import DepthConfig
from speculative.rules.sampling import SamplingParams
from speculative.target import TargetVerifier


def acceptance(
    loaded: LoadedModel,
    heads: Callable[[ModelRunner], TreeHeads],
    prompts: list[str],
    new_tokens: int = 64,
    depth: int = 5,
) -> dict[str, Any]:
    """Greedy generation of each prompt with the heads drafting (every round at `depth`) and without: tokens
    committed per target forward (the bonus included) over all prompts, per prompt, and whether each output
    equals the target's own."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    rows: list[dict[str, Any]] = []
    for text in prompts:
        prompt = chat_ids(loaded.tokenizer, text)
        runner = ModelRunner(loaded.model)
        verifier = TargetVerifier(runner, eos_ids=loaded.eos_ids, heads=heads(runner))
        fixed, eos = DepthConfig(max_depth=depth, adaptive=False), loaded.eos_ids
        drafted = SpeculativeDecoder(verifier, TreeDrafter(verifier.drafted), fixed, eos_ids=eos)
        plain = SpeculativeDecoder(
            TargetVerifier(ModelRunner(loaded.model)), None, DepthConfig(max_depth=0), eos_ids=eos
        )
        (seq,) = drafted.generate([prompt], params)
        (ref,) = plain.generate([prompt], params)
        rows.append(
            {
                "prompt": text,
                "tokens": len(seq.output),
                "steps": seq.stats.steps,
                "accepted": seq.stats.accepted,
                "acceptance_length": seq.stats.acceptance_length,
                "exact": seq.output == ref.output,
            }
        )
    steps = sum(r["steps"] for r in rows)
    return {
        "acceptance_length": (sum(r["accepted"] for r in rows) + steps) / max(steps, 1),
        "exact": f"{sum(r['exact'] for r in rows)}/{len(rows)}",
        "prompts": rows,
    }
