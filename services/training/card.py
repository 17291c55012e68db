"""`blockspec info`: a readable model card for a pair directory or a single checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from blockspec.common.errors import InvalidArgument


def _table(rows: list[dict]) -> list[str]:
    lines = ["| method | k | tau | acceptance rate | accepted per position |", "|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        lines.append(f"| {r['method']} | {r['k']} | {r['tau']:.2f} | {rate} | {r['accepted_per_pos']} |")
    return lines


def _read(file: Path) -> dict:
    """A JSON object from `file`, or InvalidArgument naming the file."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidArgument("path", f"{file}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise InvalidArgument("path", f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def describe(path: Path, dtype: str = "bfloat16", contexts: tuple[int, ...] = (4096, 32768)) -> str:
    """The card of a pair (card.json written by build-default), or the basics of one checkpoint: for a target its
    family, layer types, parameters and the bytes of a request slot at `dtype` and each of `contexts`."""
    if (path / "card.json").is_file():
        card = _read(path / "card.json")
        try:
            return _card(path, card)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a key missing or of another type
            raise InvalidArgument("path", f"{path / 'card.json'}: not a card build-default writes "
                                          f"({type(e).__name__}: {e})") from None
    if not (path / "config.json").is_file():
        raise InvalidArgument("path", f"{path} holds neither card.json nor config.json")
    cfg = _read(path / "config.json")
    training = path / "training.json"
    lines = [f"checkpoint: {path}", f"architectures: {cfg.get('architectures')}",
             f"hidden {cfg.get('hidden_size')}, layers {cfg.get('num_hidden_layers')}, vocab {cfg.get('vocab_size')}"]
    if "dflash_config" in cfg or "block_size" in cfg:
        lines.append(f"dflash_config: {json.dumps(cfg.get('dflash_config', {}))}")
    else:
        lines += _target(path, cfg, dtype, contexts)
    if training.is_file():
        t = _read(training)
        lines.append(f"training tokens {t.get('tokens_seen')}, held-out loss {t.get('heldout_loss')}, loop share {t.get('loop_share')}")
    return "\n".join(lines)


def _target(path: Path, raw: dict, dtype: str, contexts: tuple[int, ...]) -> list[str]:
    """A target checkpoint's family, layer types, parameters and bytes per request slot."""
    import torch

    from blockspec.common.models.model_config import parse_config
    from blockspec.common.runtime.footprint import parameters, slot_bytes

    cfg = parse_config(raw, path)
    types = [cfg.layer_type(i) for i in range(cfg.num_layers)]
    counts = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
    params = parameters(cfg)
    lines = [f"family: {cfg.family}; layers: {counts}",
             f"parameters: {params.total / 1e9:.2f}B" + (f", {params.active / 1e9:.2f}B active per token "
                                                         f"({cfg.experts.top_k} of {cfg.experts.num_experts} experts)"
                                                         if cfg.experts else ""),
             (f"bytes per request slot in {dtype} (speculative: rollback inputs of a 16-token verify; a DFlash "
              "drafter's taps add context x taps x hidden):"),
             "| context | KV cache | conv state | recurrent state | speculative | total |", "|---|---|---|---|---|---|"]
    for context in contexts:
        b = slot_bytes(cfg, context, getattr(torch, dtype))
        lines.append(f"| {context} | " + " | ".join(_mib(v) for v in (*b.values(), sum(b.values()))) + " |")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _card(path: Path, c: dict) -> str:
    """A pair's card.json, readable."""
    lines = [
        f"pair: {path}",
        f"target parameters:  {c['target_parameters']:,}",
        f"drafter parameters: {c['drafter_parameters']:,} ({100 * c['drafter_share_of_target']:.1f}% of the target; "
        "embedding and LM head are the target's)",
        *([f"draft vocabulary: {v['size']:,} of {v['vocab_size']:,} tokens, {v['coverage']:.1%} of {v['source']}"]
          if (v := c.get("draft_vocab")) else []),
        f"target training tokens: {c['training_tokens']}",
        f"target held-out loss:   {c['heldout_loss'] or 'n/a'} nats/token",
        f"loop share of greedy output on {c['eval_prompts']} held-out prompts: {c['loop_share']:.1%}",
        f"tau on the same prompts ({c['max_tokens']} new tokens each):",
        *_table(c["tau"]),
        "ablation at k=5 (modules switched off at inference on the same trained drafter):",
        "| dynamic conv | path selector | tau | acceptance rate |",
        "|---|---|---|---|",
        *(f"| {a['dynamic_conv']} | {a['path_selector']} | {a['tau']:.2f} | {a['acceptance_rate']} |"
          for a in c.get("ablation_k5", [])),
    ]
    if c.get("assistant_tau"):
        lines += [f"assistant (a separate causal LM, {c['assistant_parameters']:,} parameters; method draft_model, "
                  "transformers assisted generation):", *_table(c["assistant_tau"])]
    return "\n".join(lines)
