"""What looking a prompt up in the router's prefix index costs per request, in one run.

Placement asks the prefix index, for every candidate engine (producers and consumers),
how many leading tokens of the prompt the engine holds. This measures that per request
on a fleet of E engines that all hold a shared prefix (approximate views, fed the way
the router feeds them: every prompt placed), for two ways of answering it:

- ``baseline``: every engine's view walks the prompt itself, slicing and hashing each
  leading block under its parent (how the index answered before it shared chain ids;
  a faithful copy of that walk lives here as the reference);
- ``index``: the index's own answer: the prompt's blocks are looked up once in the
  chain ids the views share (:meth:`PrefixIndex.lookup`), then each engine's hit is a
  walk over integer ids.

Both answer every engine on the same prompts, and their answers are checked equal.
The two alternate within each of ``--rounds`` rounds and every figure is the median
over the rounds, so a change in the machine's load touches both alike; the ratio
``index / baseline`` is the figure to read (absolute microseconds follow the host).

    nice -n 19 python tools/bench_prefix_lookup.py --engines 1,2,4,8 --out runs/prefix_lookup.json

``--quick`` is the CI form (1 and 4 engines, 50 unrelated prompts an engine, three rounds
of 50 prompts; under a second): the answers are checked equal as in any run, and a
difference makes the exit status 1; the figures never do.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from narwhal.router.prefix import PrefixIndex, hit_limit


class BaselineView:
    """The previous approximate view: chain links ``(parent node, tokens)`` per engine."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._children: dict[tuple[object, tuple[int, ...]], int] = {}
        self._lru: OrderedDict[int, tuple[object, tuple[int, ...]]] = OrderedDict()
        self._next = itertools.count(1)

    def record(self, ids: Sequence[int]) -> None:
        bs = self.block_size
        nodes: list[int] = []
        parent: object = None
        for i in range(len(ids) // bs):
            link = (parent, tuple(ids[i * bs : (i + 1) * bs]))
            node = self._children.get(link)
            if node is None:
                node = self._children[link] = next(self._next)
                self._lru[node] = link
            nodes.append(node)
            parent = node
        for node in reversed(nodes):
            self._lru.move_to_end(node)
        while len(self._lru) > self.capacity_blocks:
            _, link = self._lru.popitem(last=False)
            del self._children[link]

    def cached_tokens(self, ids: Sequence[int]) -> int:
        bs = self.block_size
        parent: object = None
        n = 0
        for i in range(hit_limit(len(ids), bs)):
            node = self._children.get((parent, tuple(ids[i * bs : (i + 1) * bs])))
            if node is None:
                break
            parent = node
            n += 1
        return n * bs


def _prompts(rng: random.Random, prefix: list[int], count: int, tail: int) -> list[list[int]]:
    return [prefix + [rng.randrange(32000) for _ in range(tail)] for _ in range(count)]


def measure(engines: int, *, block_size: int, prefix_len: int, tail: int, history: int,
            requests: int, rounds: int, seed: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    prefix = [rng.randrange(32000) for _ in range(prefix_len)]
    names = [f"e{i}" for i in range(engines)]
    capacity = 262144
    index = PrefixIndex()
    baseline = {n: BaselineView(block_size, capacity // block_size) for n in names}
    for n in names:
        index.enable(n, block_size=block_size, capacity_tokens=capacity, events=False)
    # Each engine has served the shared prefix and `history` unrelated prompts.
    for n in names:
        for ids in [*_prompts(rng, prefix, 1, tail),
                    *([rng.randrange(32000) for _ in range(prefix_len + tail)] for _ in range(history))]:  # fmt: skip
            index.placed(n, ids)
            baseline[n].record(ids)
    asked = _prompts(rng, prefix, requests, tail)
    for ids in asked:  # both answer the same
        lookup = index.lookup(ids)
        got, want = [lookup.cached_tokens(n) for n in names], [baseline[n].cached_tokens(ids) for n in names]
        if got != want:
            raise SystemExit(f"the index answers {got} cached tokens, the baseline's walk {want} (engines {names})")
    hit = index.lookup(asked[0]).cached_tokens(names[0])

    def run_baseline() -> float:
        start = time.perf_counter()
        for ids in asked:
            for n in names:
                baseline[n].cached_tokens(ids)
        return (time.perf_counter() - start) / len(asked)

    def run_index() -> float:
        start = time.perf_counter()
        for ids in asked:
            lookup = index.lookup(ids)
            for n in names:
                lookup.cached_tokens(n)
        return (time.perf_counter() - start) / len(asked)

    base, new = [], []
    for _ in range(rounds):
        base.append(run_baseline())
        new.append(run_index())
    b, x = statistics.median(base), statistics.median(new)
    return {"engines": engines, "prompt_tokens": prefix_len + tail, "hit_tokens": hit,
            "baseline_us_per_request": b * 1e6, "index_us_per_request": x * 1e6,
            "baseline_us_per_engine": b * 1e6 / engines, "index_us_per_engine": x * 1e6 / engines,
            "ratio": x / b, "rounds": rounds}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="1,2,4,8", help="fleet sizes (comma-separated)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    p.add_argument("--tail", type=int, default=150, help="unique tokens after the prefix")
    p.add_argument("--history", type=int, default=200, help="unrelated prompts each engine served")
    p.add_argument("--requests", type=int, default=200, help="prompts per round")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--quick", action="store_true",
                   help="the CI form: 1 and 4 engines, 50 prompts of history, 3 rounds of 50 prompts")
    args = p.parse_args(argv)
    if args.quick:
        args.engines, args.history, args.requests, args.rounds = "1,4", 50, 50, 3
    rows = [measure(int(e), block_size=args.block_size, prefix_len=args.prefix, tail=args.tail,
                    history=args.history, requests=args.requests, rounds=args.rounds, seed=args.seed)
            for e in args.engines.split(",")]  # fmt: skip
    print(f"prefix-index lookup per request: {rows[0]['prompt_tokens']}-token prompt, "
          f"{rows[0]['hit_tokens']} tokens held on every engine, blocks of {args.block_size}, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print(f"{'engines':>7} {'baseline us':>12} {'index us':>9} {'per engine':>16} {'index/baseline':>15}")
    for r in rows:
        print(f"{r['engines']:>7} {r['baseline_us_per_request']:>12.1f} {r['index_us_per_request']:>9.1f} "
              f"{r['baseline_us_per_engine']:>7.1f} -> {r['index_us_per_engine']:>5.1f} {r['ratio']:>15.2f}")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"kind": "narwhal.bench-prefix-lookup", "settings": vars(args),
                                              "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
