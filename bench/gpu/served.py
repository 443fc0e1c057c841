"""The served application on the bench's random models: router, draft pool and target pool on a local Ray,
requests through the router's handle (what both front doors call), against the bandwidth bound.

No download and no oracle hook in the server: the drafts come from real draft models whose greedy choices
agree with the target's on a set share of tokens (`agreeing_draft`): the target votes for a fixed successor
of the current token (`random_models.confident_init`), and the draft's LM head is laid out so that its own
vote is that successor for `agreement` of the tokens and another token for the rest. Rows:

- plain: one request at a time, `max_draft_tokens: 0`, tokens/s and its share of the bound;
- near-free draft: a one-layer, 256-wide draft (D ~ 0): speculation at the agreement's acceptance;
- 1B draft: a Llama-3.2-1B-shaped draft on its own actor (a fractional GPU where there is one GPU),
  drafting round ahead (the shipped default) and sequentially (`router.round_ahead: false`);
- batch: plain decoding with `batch` requests at once, tokens/s over all.

    bench.gpu.served.section(bench, bound, agreement, k, batch, deadline)   # from bench/gpu/run.py
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

from bench.gpu.random_models import SHAPES, confident_init
from bench.gpu.sections import Bench

NEAR_FREE = dict(
    hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
)


@torch.no_grad()
def successors(model: PreTrainedModel, chunk: int = 4096) -> torch.Tensor:  # [V] int64
    """Each token's vote for the next token through the residual path alone (embedding -> LM head)."""
    embed: torch.Tensor = cast(Any, model.get_input_embeddings()).weight  # [V, H]
    head: torch.Tensor = cast(Any, model.get_output_embeddings()).weight  # [V, H]
    return torch.cat([(embed[i : i + chunk] @ head.T).argmax(-1) for i in range(0, embed.shape[0], chunk)])


@torch.no_grad()
def agreeing_draft(target: PreTrainedModel, shape: dict[str, Any], agreement: float, seed: int) -> PreTrainedModel:
    """A draft of `shape` (the target's vocabulary, its own untied head, no say for its layers) whose greedy
    choice after token x is the target's successor of x for `agreement` of the tokens, another token else."""
    vocab = int(target.config.vocab_size)
    config = LlamaConfig(
        max_position_embeddings=8192,
        **{**shape, "vocab_size": vocab, "tie_word_embeddings": False, "rope_theta": 500000.0},
    )
    device, dtype = target.device, target.dtype
    torch.manual_seed(seed)
    with torch.device(device):
        draft = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    confident_init(draft, 0.0, seed)  # the layers add nothing: the current token alone decides
    want = successors(target)  # [V] a permutation (the target's head is a permutation of its embeddings)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    off = torch.randperm(vocab, generator=gen)[: round((1.0 - agreement) * vocab)].to(device)
    vote = want.clone()
    vote[off] = want[off.roll(1)]  # still a permutation; each token of `off` votes for another's successor
    embed: torch.Tensor = cast(Any, draft.get_input_embeddings()).weight
    cast(Any, draft.get_output_embeddings()).weight.index_copy_(0, vote, embed)  # head[vote[x]] = embed[x]
    draft.generation_config.eos_token_id = None
    return draft


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A tokenizer of exactly `vocab` ids (words w0, w1, ...): what the app loads beside a model's weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")


def save(model: PreTrainedModel, folder: Path) -> str:
    model.save_pretrained(folder)
    word_tokenizer(int(model.config.vocab_size)).save_pretrained(folder)
    return str(folder)


def app_args(target: str, draft: str, bench: Bench, k: int, round_ahead: bool) -> dict[str, Any]:
    """The application: the bench's dtype and device, one replica per pool, the draft on its own share of the GPU."""
    cuda = bench.device.type == "cuda"
    return {
        "target_model": target,
        "draft_model": draft,
        "dtype": str(bench.target.dtype).removeprefix("torch."),
        "device": bench.device.type,
        "drafter": {"kind": "model"},
        "speculation": {"max_depth": k, "adaptive": False, "load_adaptive": False},
        "draft_pool": {"num_cpus": 1, "num_gpus": 0.25 if cuda else 0.0},
        "target_pool": {"shard_num_cpus": 1, "shard_num_gpus": 0.7 if cuda else 0.0},
        "router_pool": {"num_cpus": 1, "router": {"round_ahead": round_ahead}},
    }


@contextmanager
def local_ray(gpus: int) -> Iterator[None]:
    """Ray and Serve in this process (no HTTP or gRPC port: requests go through handles); stopped on leaving."""
    import ray
    from ray import serve

    from bench.apps import REPO

    env = {"env_vars": {"PYTHONPATH": REPO}}
    ray.init(address="local", num_cpus=4, num_gpus=gpus, include_dashboard=False, runtime_env=env)
    try:
        serve.start(proxy_location="Disabled")
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def served(args: dict[str, Any]) -> Iterator[Any]:
    """The application deployed (replicas started, graphs captured); its router's handle; deleted on leaving."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import AppConfig

    try:
        yield serve.run(build_app(AppConfig.model_validate(args)), name="bench", route_prefix=None)
    finally:
        serve.delete("bench")


def timed(handle: Any, prompts: list[list[int]], new_tokens: int, speculate: bool, concurrent: bool) -> dict[str, Any]:
    """Requests through the router (one at a time, or all at once): tokens/s, and the tokens themselves."""
    sampling = {"temperature": 0.0, "max_tokens": new_tokens, "ignore_eos": True}
    sampling |= {} if speculate else {"max_draft_tokens": 0}

    async def requests() -> list[dict[str, Any]]:
        if concurrent:
            return list(await asyncio.gather(*[handle.generate.remote(p, sampling) for p in prompts]))
        return [await handle.generate.remote(p, sampling) for p in prompts]

    start = time.perf_counter()
    outs = asyncio.run(requests())
    seconds = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outs)
    accepted = sum(int(o["usage"].get("accepted", 0)) for o in outs)
    drafted = sum(int(o["usage"].get("drafted", 0)) for o in outs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "acceptance": accepted / drafted if drafted else None,
        "outputs": [list(o["token_ids"]) for o in outs],
    }


def section(
    bench: Bench, bound_tokens_per_s: float | None, agreement: float, k: int, batch: int, deadline: float
) -> dict[str, Any]:
    """The rows of the module doc, each app started, warmed up (graphs captured at start) and measured in turn."""
    gpus = 1 if bench.device.type == "cuda" else 0
    prompts = bench.make_prompts(bench.prompts, seed=7)
    rows: dict[str, Any] = {"agreement": agreement, "k": k, "bound_tokens_per_s": bound_tokens_per_s}
    with tempfile.TemporaryDirectory(prefix="served-") as root, local_ray(gpus):
        target = save(bench.target, Path(root) / "target")
        near_free = save(agreeing_draft(bench.target, NEAR_FREE, agreement, seed=11), Path(root) / "near_free")
        draft_shape = {key: value for key, value in SHAPES[_draft_shape(bench)].items() if key != "tie_word_embeddings"}
        one_b = save(agreeing_draft(bench.target, draft_shape, agreement, seed=12), Path(root) / "draft")
        for name, draft, round_ahead in (
            ("near_free", near_free, True),
            ("draft_round_ahead", one_b, True),
            ("draft_sequential", one_b, False),
        ):
            if time.monotonic() > deadline:
                rows[name] = {"skipped": "time budget"}
                continue
            with served(app_args(target, draft, bench, k, round_ahead)) as handle:
                timed(handle, prompts[:1], 8, speculate=True, concurrent=False)  # warm-up
                if "plain" not in rows:
                    rows["plain"] = plain = timed(handle, prompts, bench.new_tokens, False, False)
                    if bound_tokens_per_s:
                        plain["share_of_bound"] = plain["tokens_per_s"] / bound_tokens_per_s
                    many = bench.make_prompts(batch, seed=8)
                    rows["batch"] = {"batch": batch, **timed(handle, many, bench.new_tokens, False, True)}
                    rows["batch"].pop("outputs")
                spec = timed(handle, prompts, bench.new_tokens, True, False)
                spec["speedup"] = spec["tokens_per_s"] / rows["plain"]["tokens_per_s"]
                spec["exact"] = spec.pop("outputs") == rows["plain"]["outputs"]
                rows[name] = spec
                print(f"  served {name}: {spec}", flush=True)
    rows["plain"].pop("outputs", None)
    if isinstance(rows.get("draft_sequential"), dict) and "tokens_per_s" in rows["draft_sequential"]:
        ahead = rows["draft_round_ahead"]["tokens_per_s"] / rows["draft_sequential"]["tokens_per_s"]
        rows["round_ahead_vs_sequential"] = ahead
    return rows


def _draft_shape(bench: Bench) -> str:
    return "llama-1b" if int(bench.target.config.vocab_size) == SHAPES["llama-1b"]["vocab_size"] else "tiny-draft"
