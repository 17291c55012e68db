"""What a draft tree would give tau on the shipped pair, before the verifier can verify one: the 16 held-out prompts,
128 new tokens, greedy and `rejection` at T 0.7 and 1.0, one request at a time, simulated outside the engine.

Each step the drafter runs its block once (the torch module, from the target's tap features of the committed tokens).
The tree grows from the anchor: a node at depth d gets branching[d] children, its candidates at slot d + 1 drawn
without replacement (Gumbel top-n) from the path selector's q(. | the node's token), or the best n when greedy. The
target scores every root-to-leaf path (transformers, one batched forward over the paths), which gives p at every node.
The walk down the tree is recursive rejection without replacement (Jeon et al., "Recursive Speculative Decoding"):
children in their drawn order, each accepted with min(1, p(x) / q(x)); after a rejection p becomes
norm(max(p - q, 0)) and q loses x (renormalised). Where no child is accepted, or at a leaf, the next token is drawn
from p as it stands. Greedy: the child equal to the argmax of p. A step's tokens are the accepted depth plus that one.

The chain [1] * k is the shipped path: its tau should sit near eval.py's (same models, other noise draws).

    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-drafter/tree_headroom.py > out.json   # every shape, ~35 min
    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-drafter/tree_headroom.py --costs   # the verify's cost by width

tree_headroom.json holds both (the shapes from two runs, `--shapes` naming the second's).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, DynamicCache

from blockspec.common.contracts import Q_WIDTH
from blockspec.common.models.decoder import rope_table
from blockspec.services.drafter.dflash.checkpoint import load_drafter
from blockspec.services.drafter.dflash.model import DrafterContext

BASE = Path(__file__).resolve().parents[3] / "models" / "base"
NEW = 128
SHAPES = {  # branching per depth: k = len(shape)
    "chain k5": [1, 1, 1, 1, 1],
    "2 first": [2, 1, 1, 1, 1],
    "3 first": [3, 1, 1, 1, 1],
    "4 first": [4, 1, 1, 1, 1],
    "2x2": [2, 2, 1, 1, 1],
    "3x2x2": [3, 2, 2, 1, 1],
    "4x2x2x2": [4, 2, 2, 2, 1],
}


class Node:
    __slots__ = ("children", "depth", "p", "q", "token")

    def __init__(self, token: int, depth: int) -> None:
        self.token, self.depth, self.children = token, depth, []
        self.q: dict[int, float] = {}  # the children's q(. | this node) over the slot's candidates
        self.p: torch.Tensor | None = None  # the target's warped distribution after this node


class Pair:
    def __init__(self, drafter: str) -> None:
        self.target = AutoModelForCausalLM.from_pretrained(BASE / "target", dtype=torch.float32).eval()
        self.drafter = load_drafter(BASE / drafter)
        self.cfg = self.drafter.cfg
        self.taps: dict[int, torch.Tensor] = {}
        for i in self.cfg.target_layer_ids:
            self.target.model.layers[i].register_forward_hook(self._hook(i))
        self.embedding = self.target.model.embed_tokens.weight
        ids = self.drafter.draft_vocab
        self.ids = ids if ids is not None else torch.arange(self.embedding.shape[0])
        self.lm_head = self.target.lm_head.weight[self.ids]
        self.cos, self.sin = rope_table(self.cfg, 4096)

    def _hook(self, i: int):
        def keep(_module, _args, out):
            self.taps[i] = out[0] if isinstance(out, tuple) else out
        return keep

    @torch.inference_mode()
    def start(self, prompt: list[int]) -> None:
        """A new request: the context is the prompt but its last token (the first anchor)."""
        self.cache = DynamicCache()
        self.features = torch.zeros(0, len(self.cfg.target_layer_ids) * self.cfg.hidden_size)
        self.commit(prompt[:-1])

    @torch.inference_mode()
    def commit(self, tokens: list[int]) -> None:
        """Tokens joining the context: their K/V into the cache, their tap features kept."""
        if not tokens:
            return
        self.target.model(torch.tensor([tokens]), cache=self.cache, use_cache=True)
        new = torch.cat([self.taps[i][0] for i in self.cfg.target_layer_ids], -1)
        self.features = torch.cat([self.features, new])

    @torch.inference_mode()
    def block(self, anchor: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafter's block after the context and `anchor` -> the slots' hidden [k, H], unary scores and
        candidate ids [k, top_k]."""
        C = self.features.shape[0]
        ctx = self.drafter.context(self.features)[None]
        layer_kv = self.drafter.context_kv(ctx, self.cos[:C][None, None], self.sin[:C][None, None])
        B = self.cfg.block_size
        positions = torch.arange(C, C + B)[None]
        dctx = DrafterContext(layer_kv, torch.ones(1, C, dtype=torch.bool),
                              (self.cos[positions][:, None], self.sin[positions][:, None]), self.cfg, positions)
        block_ids = torch.full((1, B), self.cfg.mask_token_id)
        block_ids[0, 0] = anchor
        hidden = self.drafter(self.drafter.block_embeds(self.embedding, block_ids), dctx, True)[0, 1:1 + k]
        unary, cand = self.drafter.draft_logits(hidden, self.lm_head).topk(min(Q_WIDTH, self.cfg.selector_top_k), -1)
        return hidden, unary, self.ids[cand]

    @torch.inference_mode()
    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor, t: int,
               parent: int) -> torch.Tensor:
        """The path selector's scores of slot t's candidates after the token `parent`."""
        sel = self.drafter.candidate_selector
        return sel.scores(hidden[t], unary[t], cand[t], torch.tensor(parent))

    @torch.inference_mode()
    def path_logits(self, anchor: int, paths: list[list[int]]) -> torch.Tensor:
        """The target's logits [L, d + 1, V] at the anchor and after each token of each path (all of length d), over
        a copy of the context's cache."""
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(len(paths))
        C = self.features.shape[0]
        ids = torch.tensor([[anchor, *path] for path in paths])
        positions = torch.arange(C, C + ids.shape[1])[None].expand(len(paths), -1)
        return self.target(ids, cache=cache, position_ids=positions, use_cache=True).logits


def grow(pair: Pair, anchor: int, shape: list[int], temperature: float, gen: torch.Generator) -> Node:
    hidden, unary, cand = pair.block(anchor, len(shape))
    root = Node(anchor, 0)
    frontier = [root]
    for t, n in enumerate(shape):
        nxt = []
        for node in frontier:
            s = pair.scores(hidden, unary, cand, t, node.token).double()
            if temperature == 0.0:
                order = s.argsort(descending=True)[:n]
            else:
                logq = (s / temperature).log_softmax(-1)
                node.q = dict(zip(cand[t].tolist(), logq.exp().tolist()))
                u = torch.rand(s.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
                order = (logq - (-u.log()).log()).argsort(descending=True)[:n]  # Gumbel top-n: without replacement
            for j in order.tolist():
                child = Node(int(cand[t, j]), t + 1)
                node.children.append(child)
                nxt.append(child)
        frontier = nxt
    # p at every node: the target over each root-to-leaf path
    paths, chains = [], []

    def collect(node: Node, trail: list[Node]) -> None:
        if not node.children:
            paths.append([n.token for n in trail])
            chains.append([root, *trail])
        for child in node.children:
            collect(child, [*trail, child])

    collect(root, [])
    for row, chain in zip(pair.path_logits(anchor, paths), chains):
        for node, logits in zip(chain, row):
            if node.p is None:
                node.p = logits if temperature == 0.0 else (logits.double() / temperature).softmax(-1)
    return root


def walk(root: Node, temperature: float, gen: torch.Generator) -> list[int]:
    """The tokens one verify of the tree commits."""
    out, node = [], root
    while True:
        if temperature == 0.0:
            best = int(node.p.argmax())
            nxt = next((c for c in node.children if c.token == best), None)
            out.append(best)
            if nxt is None:
                return out
            node = nxt
            continue
        p, q = node.p.clone(), dict(node.q)
        accepted = None
        for child in node.children:
            x = child.token
            if torch.rand((), generator=gen, dtype=torch.float64) < min(1.0, float(p[x]) / q[x]):
                accepted = child
                break
            for y, qy in q.items():  # p <- norm(max(p - q, 0))
                p[y] = max(float(p[y]) - qy, 0.0)
            total = float(p.sum())
            p = p / total if total > 0 else node.p.clone()
            del q[x]
            mass = sum(q.values())
            q = {y: v / mass for y, v in q.items()} if mass > 0 else q
        if accepted is None:
            out.append(int(torch.multinomial(p.float(), 1, generator=gen)))
            return out
        out.append(accepted.token)
        node = accepted


def self_check() -> float:
    """Total variation between p and what one tree level's walk emits (6 tokens, 3 children of 4 candidates): the rule
    is exact, so this is sampling noise (about 0.004 at 50,000 draws)."""
    gen = torch.Generator().manual_seed(7)
    p = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10], dtype=torch.float64)
    logq = torch.tensor([0.10, 0.40, 0.05, 0.45], dtype=torch.float64).log()
    cand = [0, 1, 3, 5]
    counts = torch.zeros(6, dtype=torch.float64)
    draws = 50_000
    for _ in range(draws):
        u = torch.rand(4, generator=gen, dtype=torch.float64)
        order = (logq - (-u.log()).log()).argsort(descending=True)[:3]
        root = Node(-1, 0)
        root.p, root.q = p, dict(zip(cand, logq.exp().tolist()))
        root.children = [Node(cand[j], 1) for j in order.tolist()]
        for c in root.children:
            c.p = p  # what follows a child is not counted: only the first token
        counts[walk(root, 1.0, gen)[0]] += 1
    return float((counts / draws - p).abs().sum() / 2)


def run(pair: Pair, prompts: list[list[int]], shape: list[int], temperature: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    steps = tokens = 0
    for prompt in prompts:
        pair.start(prompt)
        anchor, made = prompt[-1], 0
        while made < NEW:
            got = walk(grow(pair, anchor, shape, temperature, gen), temperature, gen)[: NEW - made]
            pair.commit([anchor, *got[:-1]])
            anchor = got[-1]
            made += len(got)
            steps += 1
            tokens += len(got)
    return {"tau": round(tokens / steps, 3), "steps": steps}


def nodes(shape: list[int]) -> int:
    total, width = 0, 1
    for n in shape:
        width *= n
        total += width
    return total


def verify_costs(widths: list[int], context: int = 160, repeats: int = 30) -> dict:
    """The shipped target's verify over `width` tokens against a decode, on the engine's own verifier (the chain's
    causal mask; a tree's differs only in which keys each row sees): bench's r(width) at a 160-token context."""
    from blockspec.services.bench.costs import cost_ratios
    from blockspec.services.engine.engine import Engine

    engine = Engine(BASE / "target", None, "none", max_batch=1, max_len=context + max(widths) + 8, threads=2)
    engine.verifier.add("x", list(range(16, 16 + context)))
    engine.verifier.prefill(["x"])
    decode, r, _ = cost_ratios(engine.verifier, None, "x", [w - 1 for w in widths], repeats)
    return {"decode_ms": round(decode * 1e3, 3), "r": {w: round(r[w - 1], 2) for w in widths}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", default="drafter-sampled")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--prompts", type=int, default=16, help="the first N held-out prompts")
    parser.add_argument("--costs", action="store_true", help="only the verify costs at the shapes' widths")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.costs:
        widths = sorted({nodes(shape) + 1 for shape in SHAPES.values()})
        print(json.dumps(verify_costs(widths), indent=1))
        return
    tv = self_check()
    pair = Pair(args.drafter)
    tok = Tokenizer.from_file(str(BASE / "target" / "tokenizer.json"))
    prompts = [tok.encode(json.loads(line)).ids for line in (BASE / "heldout_prompts.jsonl").read_text().splitlines()]
    prompts = prompts[: args.prompts]
    out = {"drafter": args.drafter, "self_check_total_variation": round(tv, 4), "shapes": {}}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        row = {"branching": shape, "verified_tokens": nodes(shape) + 1}
        start = time.time()
        row["greedy"] = run(pair, prompts, shape, 0.0, 0)["tau"]
        for temperature in (0.7, 1.0):
            taus = [run(pair, prompts, shape, temperature, seed)["tau"] for seed in range(args.seeds)]
            row[f"T {temperature}"] = {"tau_by_seed": taus, "tau_mean": round(sum(taus) / len(taus), 3)}
        row["seconds"] = round(time.time() - start)
        out["shapes"][name] = row
        print(name, row, file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
