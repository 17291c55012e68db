"""`blockspec build-default`, `build-assistant`, `info`, `train-drafter` and `draft-vocab`: the commands that
build, describe and tune models."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from blockspec.common.argtypes import bounded
from blockspec.common.contracts import Q_WIDTH
from blockspec.common.errors import InvalidArgument
from blockspec.services.cli.args import minutes, out_dir, threads


def add_model_commands(sub) -> None:
    """Register the model commands on the CLI's subparsers."""
    bd = sub.add_parser("build-default", help="build (or find) the default target/drafter pair")
    bd.add_argument("--profile", choices=("tiny", "base"), default="base", help="tiny: <1 min, tests; base: hours")
    bd.add_argument("--home", help="where pairs live (default: $BLOCKSPEC_HOME or the repository's models/)")
    bd.add_argument("--work", default=".cache/default-pair/base", help="base: resumable training directory")
    bd.add_argument("--minutes", type=minutes, default=125, help="base: target training budget")
    bd.add_argument("--threads", type=threads, default=2)
    bd.add_argument("--json", action="store_true", help='last line: {"target": DIR, "drafter": DIR}')
    bd.set_defaults(func=cmd_build_default)
    ba = sub.add_parser("build-assistant", help="train the base pair's small causal draft model (draft_model, "
                        "transformers assisted generation) on the target's greedy continuations")
    ba.add_argument("--home", help="where pairs live (default: $BLOCKSPEC_HOME or the repository's models/)")
    ba.add_argument("--work", default=".cache/default-pair/base", help="the base pair's training directory (its data; "
                    "the assistant's checkpoint goes there: a rerun resumes)")
    ba.add_argument("--steps", type=bounded(1), help="training steps (default: the shipped assistant's 4000, ~40 min on one core)")
    ba.add_argument("--threads", type=threads, default=1)
    ba.set_defaults(func=cmd_build_assistant)
    info = sub.add_parser("info", help="model card of a pair directory (or of a target or drafter checkpoint)")
    info.add_argument("path")
    info.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                      help="a target's per-slot bytes at this dtype (default bfloat16)")
    info.add_argument("--context", type=lambda v: tuple(int(c) for c in v.split(",")), default=(4096, 32768),
                      help="comma list of context lengths for a target's per-slot bytes (default 4096,32768)")
    info.set_defaults(func=cmd_info)
    td = sub.add_parser("train-drafter", help="distil a DFlash-2 drafter from a target")
    td.add_argument("--target", required=True)
    td.add_argument("--out", required=True)
    td.add_argument("--text-file", nargs="+", required=True, help="text files or directories: prompt source")
    td.add_argument("--prompts", type=bounded(1), default=512, help="prompts whose continuations supervise")
    td.add_argument("--prompt-len", type=bounded(1), default=64)
    td.add_argument("--new-tokens", type=bounded(1), default=128)
    td.add_argument("--steps", type=bounded(1), default=2000)
    td.add_argument("--block-size", type=bounded(2, 64), default=8, help="anchor + draft slots (k up to block size - 1)")
    td.add_argument("--layers", type=bounded(1, 64), default=1)
    td.add_argument("--seed", type=bounded(0, 2**32 - 1), default=0)
    td.add_argument("--temperatures", type=_temperatures, default=(0.0,),
                    help="comma list: prompt i's continuation is sampled at the i %% n-th (0: greedy; default 0). "
                         "Requests that sample at T 0.7 want a drafter trained on such continuations, e.g. 0,0.7,1")
    td.add_argument("--kl-weight", type=float, default=0.0,
                    help="weight of the soft term: cross-entropy to the target's distribution at each drafted slot "
                         "(its top tokens; default 0: the sampled tokens only)")
    td.add_argument("--kl-temperature", type=float, default=1.0, help="the target's distribution for the soft terms: "
                                                                       "softmax(logits / this) (default 1)")
    td.add_argument("--kl-top-k", type=bounded(1, 1024), default=32,
                    help="the target's most likely tokens kept for the soft terms, renormalised (default 32)")
    td.add_argument("--selector-top-k", type=bounded(1, Q_WIDTH), default=16,
                    help="candidates per slot of the path selector (default 16)")
    td.add_argument("--sampling-top-k", type=bounded(1, Q_WIDTH),
                    help="candidates per slot that a request which samples draws from, the drafter's top ones: its "
                         f"q's support (at least --selector-top-k, at most {Q_WIDTH}; default: --selector-top-k)")
    td.add_argument("--selector-kl-weight", type=float, default=0.0,
                    help="weight of the selector's soft term: cross-entropy to the target's distribution over its "
                         "candidates (default 0)")
    td.add_argument("--selector-only", action="store_true",
                    help="train the path selector only (needs --init-from): the drafter's layers stay as they are")
    td.add_argument("--init-from", help="a drafter to start from (a refinement run); with more --layers, the added ones start as the identity")
    td.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3; lower for --init-from)")
    td.set_defaults(func=cmd_train_drafter)
    dv = sub.add_parser("draft-vocab", help="restrict a DFlash drafter's LM head to the most frequent tokens of a text "
                        "(draft_vocab.json in its directory; docs/models.md)")
    dv.add_argument("--drafter", required=True, help="the DFlash drafter's directory (the file is written there)")
    dv.add_argument("--target", required=True, help="its target (tokenizer and vocabulary)")
    dv.add_argument("--text-file", nargs="+", required=True, help="text files or directories (.py/.txt) to count tokens in")
    dv.add_argument("--size", type=int, help="tokens kept, a multiple of 64 (default: half the vocabulary)")
    dv.set_defaults(func=cmd_draft_vocab)


def cmd_build_default(args: argparse.Namespace) -> int:
    from blockspec.services.training.default_pair import build_default

    paths = build_default(args.profile, Path(args.home) if args.home else None, Path(args.work), args.minutes, args.threads)
    if args.json:
        print(json.dumps({"target": str(paths.target), "drafter": str(paths.drafter)}))
    else:
        print(f"target:  {paths.target}\ndrafter: {paths.drafter}\ncard:    {paths.card}")
    return 0


def cmd_build_assistant(args: argparse.Namespace) -> int:
    from blockspec.services.training.assistant import AssistantConfig
    from blockspec.services.training.default_pair import PairPaths, build_assistant, default_home

    paths = PairPaths((Path(args.home) if args.home else default_home()) / "base")
    if not paths.built():
        raise InvalidArgument("--home", f"{paths.root}: no built base pair (run build-default first)")
    if not (Path(args.work) / "data" / "train.npy").is_file():
        raise InvalidArgument("--work", f"{args.work}: no training data of the base pair (data/train.npy)")
    card = build_assistant(paths, Path(args.work), AssistantConfig(**({"steps": args.steps} if args.steps is not None else {})), args.threads)
    print(f"assistant: {paths.assistant}\ntau (draft_model): " +
          ", ".join(f"k={r['k']} {r['tau']}" for r in card["assistant_tau"]))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from blockspec.services.training.card import describe

    print(describe(Path(args.path), args.dtype, args.context))
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.training.default_pair import distill
    from blockspec.services.training.distill import DistillConfig

    if args.selector_only and not args.init_from:
        raise InvalidArgument("--selector-only", "trains the path selector of a drafter: give it --init-from")
    if args.sampling_top_k is not None and args.sampling_top_k < args.selector_top_k:
        raise InvalidArgument("--sampling-top-k", f"{args.sampling_top_k} is under --selector-top-k "
                                                  f"{args.selector_top_k}: a walk that samples sees at least the "
                                                  "greedy walk's candidates")
    tokenizer = load_checkpoint(args.target).tokenizer
    out_dir(args.out)  # before the training, not after it
    ids = tokenizer.encode("\n".join(_read_texts(args.text_file)))
    if len(ids) < args.prompt_len + 1:
        raise InvalidArgument("--text-file", f"{len(ids)} tokens of text; need more than --prompt-len {args.prompt_len}")
    cfg = DistillConfig(steps=args.steps, block_size=args.block_size, num_layers=args.layers, seed=args.seed,
                        temperatures=args.temperatures, kl_weight=args.kl_weight, kl_temperature=args.kl_temperature,
                        kl_top_k=args.kl_top_k, selector_top_k=args.selector_top_k, sampling_top_k=args.sampling_top_k,
                        selector_kl_weight=args.selector_kl_weight, selector_only=args.selector_only,
                        init_from=args.init_from, lr=args.lr)
    distill(Path(args.target), Path(args.out), ids, args.prompts, args.prompt_len, args.new_tokens, cfg)
    print(f"drafter: {args.out}")
    return 0


def _temperatures(value: str) -> tuple[float, ...]:
    try:
        temps = tuple(float(t) for t in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a comma list of numbers, e.g. 0,0.7,1") from None
    bad = [t for t in temps if not (t == 0 or 1e-5 <= t <= 100)]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]}: each temperature is 0 (greedy) or in [1e-5, 100]")
    return temps


def _read_texts(names: list[str]) -> list[str]:
    """--text-file: the text of each file, and of each .py / .txt file under a directory."""
    texts = []
    for name in names:
        path = Path(name)
        files = sorted(path.rglob("*.py")) + sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        if not path.exists() or not files:
            raise InvalidArgument("--text-file", f"{path} is not a text file or a directory holding .py/.txt files")
        texts += [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return texts


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from blockspec.common.models.checkpoint import load_checkpoint, read_config
    from blockspec.services.drafter.dflash import draft_vocab
    from blockspec.services.drafter.dflash.checkpoint import check_fits_target
    from blockspec.services.drafter.dflash.config import DFlashConfig

    target = load_checkpoint(args.target, with_weights=False)
    # The config only: neither the weights nor a draft vocabulary already there (this rewrites it) are read.
    check_fits_target(DFlashConfig.from_hf(read_config(args.drafter), args.drafter), target.config, args.drafter)
    vocab = target.config.vocab_size
    if args.size is not None:
        try:
            draft_vocab.check_size(args.size, vocab)
        except ValueError as e:
            raise InvalidArgument("--size", str(e)) from e
    texts = _read_texts(args.text_file)
    info = draft_vocab.build(args.drafter, vocab, target.config.eos_token_ids, (target.tokenizer.encode(t) for t in texts),
                             args.size, f"{len(texts)} text files ({', '.join(args.text_file)})")
    print(f"draft vocabulary: {info['size']} of {vocab} tokens, {info['coverage']:.1%} of the {info['corpus_tokens']} "
          f"tokens of the text -> {Path(args.drafter) / draft_vocab.FILE}")
    return 0
