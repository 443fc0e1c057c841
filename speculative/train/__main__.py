"""Train Medusa heads or an EAGLE head for a target, here on the CPU, and save them in the published layout.

    python -m speculative.train medusa|eagle --target FOLDER --out FOLDER [--minutes 20] [--text-tokens 30000]

The data (`data.py`): the target's greedy answers to `prompts.TRAIN` and standard-library text, with the
target's features at every position, built once per target and data size and kept beside the output
(`--corpus`). The fit (`fit.py`) runs for `--minutes` with a progress bar; then the heads are saved
(config.json and weights, in FasterDecoding/Medusa's or SafeAILab/EAGLE's layout), with `training.json`
(data size, time, losses, and the acceptance length on the held-out prompts of `prompts.HELD_OUT`) and
`loss.png` (the loss per step). `--skip-existing` leaves a finished folder alone (`make heads`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from speculative.drafters.config import heads_factory
from speculative.drafters.eagle import save_eagle
from speculative.drafters.medusa import save_medusa
from speculative.engine.loading import load_model
from speculative.train import prompts
from speculative.train.data import Corpus, build_corpus
from speculative.train.evaluate import acceptance
from speculative.train.fit import Budget, Fitted, MedusaFit, eagle_shape, fit_eagle, fit_medusa

RECORD = "training.json"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m speculative.train", description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=["medusa", "eagle"])
    parser.add_argument("--target", required=True, help="the target model's folder (HF layout)")
    parser.add_argument("--out", required=True, help="the folder the heads are saved in")
    parser.add_argument("--minutes", type=float, default=20.0, help="time budget of the fit")
    parser.add_argument("--answer-tokens", type=int, default=160, help="most tokens of each greedy answer")
    parser.add_argument("--text-tokens", type=int, default=30_000, help="tokens of standard-library text")
    parser.add_argument("--heads", type=int, default=3, help="medusa: heads")
    parser.add_argument("--intermediate", type=int, default=None, help="eagle: MLP width (default: the target's)")
    parser.add_argument("--corpus", default=None, help="where the data is cached (default: beside --out)")
    parser.add_argument("--eval-tokens", type=int, default=64, help="new tokens per held-out prompt (0: no eval)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--skip-existing", action="store_true", help="leave a folder that holds training.json")
    args = parser.parse_args()
    out = Path(args.out).expanduser()
    if args.skip_existing and (out / RECORD).exists():
        print(f"{out}: already trained ({RECORD})")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_model(args.target, "bfloat16")
    corpus = _corpus(args, loaded, out)
    built = time.perf_counter() - started
    print(f"data: {corpus.tokens} tokens in {len(corpus.samples)} sequences ({corpus.answers} greedy answers)")
    model: Any = loaded.model
    lm_head = model.get_output_embeddings().weight.detach()
    if args.kind == "medusa":
        budget = Budget(args.minutes, seed=args.seed)
        heads, fitted = fit_medusa(corpus, lm_head, budget, MedusaFit(heads=args.heads))
        save_medusa(heads.to(torch.bfloat16), out, args.target)
        trained: Any = heads
    else:
        embed = model.get_input_embeddings().weight.detach()
        shape = eagle_shape(model.config, args.intermediate)
        trained, fitted = fit_eagle(corpus, embed, lm_head, shape, Budget(args.minutes, seed=args.seed))
        save_eagle(trained.to(torch.bfloat16), out, args.target)
    record: dict[str, Any] = {
        "kind": args.kind,
        "target": args.target,
        "data": {"tokens": corpus.tokens, "sequences": len(corpus.samples), "greedy_answers": corpus.answers},
        "data_seconds": built,
        "fit": {"steps": fitted.steps, "seconds": fitted.seconds, "positions": fitted.positions},
        "loss_first_50": _mean(fitted.losses[:50]),
        "loss_last_50": _mean(fitted.losses[-50:]),
        "threads": torch.get_num_threads(),
    }
    if args.eval_tokens:
        factory = heads_factory(trained.to(torch.bfloat16), model)
        held = record["held_out"] = acceptance(loaded, factory, prompts.HELD_OUT, args.eval_tokens)
        print(f"held-out acceptance length {held['acceptance_length']:.2f}, exact {held['exact']}")
    (out / RECORD).write_text(json.dumps(record, indent=2))
    _plot(fitted, out / "loss.png", args.kind)
    print(f"saved {out} ({time.perf_counter() - started:.0f} s in all)")


def _corpus(args: argparse.Namespace, loaded: Any, out: Path) -> Corpus:
    """The data for this target and size, built once and kept (`--corpus`)."""
    key = json.dumps([str(Path(args.target).resolve()), args.answer_tokens, args.text_tokens, args.seed, prompts.TRAIN])
    path = Path(args.corpus) if args.corpus else out.parent / f"corpus-{hashlib.sha1(key.encode()).hexdigest()[:12]}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    corpus = build_corpus(loaded, prompts.TRAIN, args.answer_tokens, args.text_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(corpus, path)
    return corpus


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _plot(fitted: Fitted, path: Path, kind: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # (a dev dependency) the losses are in training.json too
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(fitted.losses, linewidth=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{kind} heads: training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
