r"""Token-budget plans on the uneven workload, no model: the greedy cut (fewest micro-batches) against the least-cost
cut (dynamic programming, ``lit_grpo.core.micro_batch_plan.plan_by_tokens``), and for sharded ranks the two ways
of cutting a rank's rows into an agreed number of parts.

The lengths are those of ``benchmarks/uneven_lengths.py``'s random model, read two ways:

* ``recorded``: the completion lengths of every step of the committed runs
  (``experiments/results/uneven_lengths/*.json``, 2 x 8 and 1 x 8 completions), with the lengths of the prompts
  those steps trained on (GSM8K train rows ``prompt_rows``, chat-formatted with the default system prompt by the
  SmolLM2 tokenizer the random model carries);
* ``drawn``: the model's law without the model. Its EOS comes with probability ``--eos-rate`` (1/150) per token, so
  a completion ends after k tokens with probability ``(1 - q)^(k-1) q``, capped at ``--max-new-tokens`` (512);
  ``--draws`` batches of ``--prompts`` x ``--generations``, prompts in the data module's order (seed 0).

Per plan: micro-batches per batch and the padded fraction, padded positions / positions computed, each
micro-batch its distinct prompts ``[u, P']`` and its completions ``[s, C']`` (what the module logs as
``train/padded_fraction``; the recorded runs' logged values are printed beside the recomputed greedy ones). Packed
plans pay no padding; their micro-batch counts are compared.

``--ranks``: each of R ranks draws its own batch; the ranks agree on the largest number of micro-batches any of
them plans, and each cuts its rows into that many (``split_into``: the smallest largest cost), against the least
total cost among the cuts with that number of parts and that smallest largest cost.

    python benchmarks/plan_padding.py                    # budgets 2048 4096 8192, 200 draws of 1 x 8, 2 x 8, 8 x 8
    python benchmarks/plan_padding.py --budgets 4096 --prompts 2 --draws 1000 --ranks 2 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lit_grpo.core.micro_batch_plan import (  # noqa: E402
    _cut,
    length_order,
    packed_tokens,
    padded_tokens,
    plan_by_tokens,
    split_into,
)

RECORDED = [ROOT / "experiments/results/uneven_lengths/uneven_lengths.json",
            ROOT / "experiments/results/uneven_lengths/against_trl.json"]

Batch = tuple[list[int], list[int], list[int]]  # completion lengths, prompt lengths, groups


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096, 8192], help="data.micro_batch_tokens")
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 8], help="prompts per drawn batch")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--draws", type=int, default=200, help="drawn batches per shape")
    parser.add_argument("--eos-rate", type=float, default=1 / 150, help="p(EOS) per token of the random model")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4], help="sharded ranks for the split_into rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the table's numbers as JSON here")
    args = parser.parse_args(argv)
    if min(args.budgets) < 1 or min(args.prompts) < 1 or args.generations < 1 or args.draws < 1:
        parser.error("budgets, prompts, generations and draws must be >= 1")
    if not 0.0 < args.eos_rate < 1.0:
        parser.error(f"--eos-rate must be a probability in (0, 1), got {args.eos_rate}")
    return args


def prompt_lengths_of(rows: list[int]) -> dict[int, int]:
    """Tokens of each GSM8K train row's chat-formatted prompt, as the benchmark's data module builds it."""
    from make_random_model import load_tokenizer

    from lit_grpo.data.gsm8k import load_gsm8k
    from lit_grpo.data.prompts import prompt_ids

    tokenizer, data = load_tokenizer(None), load_gsm8k("bundled", "train")
    return {row: len(prompt_ids(tokenizer, data[row]["question"])) for row in rows}


def recorded_batches() -> list[tuple[str, Batch, float | None]]:
    """Every step of the committed runs: its name, lengths and the module's logged padded fraction (or None)."""
    runs = []
    for path in RECORDED:
        report = json.loads(path.read_text())
        generations = report["config"]["generations"]
        for sides in report["runs"].values():
            # TRL's side trains on the same rows (step_time.prompt_rows): take them from a side that lists them
            rows = next(side["prompt_rows"] for side in sides.values() if side.get("prompt_rows"))
            for name, side in sides.items():
                steps = side.get("warmup_steps", []) + side.get("measured_steps", [])
                for index, step in enumerate(steps):
                    lengths = step["lengths"]
                    prompts = len(lengths) // generations
                    runs.append((f"{path.stem}/{name}/{index}",
                                 (lengths, rows[index * prompts:(index + 1) * prompts], generations),
                                 step.get("module_padded_fraction")))
    lengths_of = prompt_lengths_of(sorted({r for _, (_, rows, _), _ in runs for r in rows}))
    batches = []
    for name, (lengths, rows, generations), logged in runs:
        groups = [i // generations for i in range(len(lengths))]
        batches.append((name, (lengths, [lengths_of[rows[g]] for g in groups], groups), logged))
    return batches


def drawn_batches(args: argparse.Namespace, prompts: int, count: int, rng: random.Random,
                  prompt_pool: list[int]) -> list[Batch]:
    """``count`` batches of the random model's law: geometric lengths capped at the budget."""
    batches = []
    for b in range(count):
        lengths = []
        for _ in range(prompts * args.generations):
            k = 1
            while k < args.max_new_tokens and rng.random() >= args.eos_rate:
                k += 1
            lengths.append(k)
        groups = [i // args.generations for i in range(len(lengths))]
        pool = [prompt_pool[(b * prompts + g) % len(prompt_pool)] for g in range(prompts)]
        batches.append((lengths, [pool[g] for g in groups], groups))
    return batches


def cost(run: list[int], batch: Batch, packed: bool = False) -> int:
    c, p, g = batch
    if packed:
        return packed_tokens([c[r] for r in run], [p[r] for r in run])
    return padded_tokens([c[r] for r in run], [p[r] for r in run], [g[r] for r in run])


def real_tokens(run: list[int], batch: Batch) -> int:
    """The real tokens of a padded micro-batch: its distinct prompts once and its completions."""
    c, p, g = batch
    return sum({g[r]: p[r] for r in run}.values()) + sum(c[r] for r in run)


def greedy(batch: Batch, budget: int, packed: bool = False) -> list[list[int]]:
    """The cut this change replaces: the fewest contiguous runs of the sorted rows within the budget."""
    c, p, g = batch
    return [sorted(run) for run in _cut(length_order(c, g), c, p, g, budget, packed)]


def exact_parts_least_total(batch: Batch, parts: int) -> list[list[int]]:
    """Exactly ``parts`` contiguous runs of the sorted rows whose largest cost is ``split_into``'s (the smallest
    any such cut reaches) and whose total is the least among those: dynamic programming over (runs left, first
    row), O(parts x n x rows per run), the candidate this script measures against ``split_into``."""
    c, p, g = batch
    order = length_order(c, g)
    cap = max(cost(run, batch) for run in split_into(c, p, g, parts))
    n = len(order)
    runs_from: list[list[tuple[int, int]]] = []  # for each first row i: (end, cost) of every run within cap
    for i in range(n):
        longest = prompt_longest = 0
        prompts: set[int] = set()
        ends = []
        for j in range(i, n):
            row = order[j]
            longest, prompt_longest = max(longest, c[row]), max(prompt_longest, p[row])
            prompts.add(g[row])
            run_cost = (j - i + 1) * longest + len(prompts) * prompt_longest
            if run_cost > cap:
                break
            ends.append((j + 1, run_cost))
        runs_from.append(ends)
    inf = float("inf")
    # best[k][i]: the least total of the rows order[i:] in k runs, each within cap; end[k][i] its first run's end
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    end = [[n] * (n + 1) for _ in range(parts + 1)]
    best[0][n] = 0
    for k in range(1, parts + 1):
        for i in range(n - 1, -1, -1):
            for j, run_cost in runs_from[i]:
                if run_cost + best[k - 1][j] <= best[k][i]:
                    best[k][i], end[k][i] = run_cost + best[k - 1][j], j
    cut, i = [], 0
    for k in range(parts, 0, -1):
        cut.append(sorted(order[i:end[k][i]]))
        i = end[k][i]
    return cut


def summary(plans: list[tuple[list[list[int]], Batch]]) -> dict[str, float]:
    """Micro-batches per batch (mean), padded fraction over all of them, and the largest micro-batch's cost."""
    computed = sum(cost(run, batch) for plan, batch in plans for run in plan)
    real = sum(real_tokens(run, batch) for plan, batch in plans for run in plan)
    return {"micro_batches": statistics.fmean(len(plan) for plan, _ in plans),
            "padded_fraction": (computed - real) / computed, "computed_tokens": computed,
            "largest": max(cost(run, batch) for plan, batch in plans for run in plan)}


def compare(batches: list[Batch], budget: int) -> dict[str, dict[str, float]]:
    packed_greedy = [len(greedy(b, budget, True)) for b in batches]
    packed_dp = [len(plan_by_tokens(*b, budget, packed=True)) for b in batches]
    return {"greedy": summary([(greedy(b, budget), b) for b in batches]),
            "dp": summary([(plan_by_tokens(*b, budget), b) for b in batches]),
            "packed": {"greedy_micro_batches": statistics.fmean(packed_greedy),
                       "dp_micro_batches": statistics.fmean(packed_dp),
                       "same_plans": float(all(greedy(b, budget, True) == plan_by_tokens(*b, budget, packed=True)
                                               for b in batches))}}


def sharded(batches: list[Batch], ranks: int, budget: int) -> dict[str, dict[str, float]]:
    """Groups of ``ranks`` batches, one per rank: each plans by the least-cost cut, the ranks take the largest
    count, and the ranks with fewer cut into that many parts, by ``split_into`` or by the least total."""
    rows: dict[str, list] = {"own": [], "split_into": [], "least_total": []}
    seconds = {"split_into": 0.0, "least_total": 0.0}
    forced = 0
    for start in range(0, len(batches) - ranks + 1, ranks):
        group = batches[start:start + ranks]
        own = [plan_by_tokens(*b, budget) for b in group]
        parts = max(len(plan) for plan in own)
        for plan, b in zip(own, group):
            rows["own"].append((plan, b))
            if len(plan) == parts:  # the rank's own plan is kept (lit_grpo.training.module.micro_batches)
                rows["split_into"].append((plan, b))
                rows["least_total"].append((plan, b))
                continue
            forced += 1
            for name, how in (("split_into", split_into), ("least_total", exact_parts_least_total)):
                clock = time.perf_counter()
                cut = how(*b, parts) if how is split_into else how(b, parts)
                seconds[name] += time.perf_counter() - clock
                rows[name].append((cut, b))
    result = {name: summary(plans) for name, plans in rows.items()}
    result["forced"] = {"share": forced / max(1, len(rows["own"])),
                        **{f"{name}_ms": 1e3 * s / max(1, forced) for name, s in seconds.items()}}
    return result


def plan_seconds(batch: Batch, budget: int, repeats: int = 3) -> tuple[float, float]:
    """Best seconds of the greedy cut and of ``plan_by_tokens`` on one batch."""
    times = []
    for plan in (greedy, plan_by_tokens):
        best = float("inf")
        for _ in range(repeats):
            clock = time.perf_counter()
            plan(*batch, budget) if plan is plan_by_tokens else plan(batch, budget)
            best = min(best, time.perf_counter() - clock)
        times.append(best)
    return times[0], times[1]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    from lit_grpo.data.gsm8k import load_gsm8k
    from lit_grpo.data.prompt_order import epoch_permutation

    order = epoch_permutation(0, 0, len(load_gsm8k("bundled", "train")))
    recorded = recorded_batches()
    pool_rows = order[: max(args.prompts) * args.draws * max([1, *args.ranks])]
    lengths_of = prompt_lengths_of(pool_rows)
    pool = [lengths_of[r] for r in pool_rows]
    rng = random.Random(args.seed)
    drawn = {prompts: drawn_batches(args, prompts, args.draws * max([1, *args.ranks]), rng, pool)
             for prompts in args.prompts}

    report: dict = {"config": vars(args) | {"output": str(args.output)}, "recorded": {}, "drawn": {}, "ranks": {}}
    print("recorded steps (greedy at 4096 recomputed against the logged train/padded_fraction):")
    for name, batch, logged in recorded:
        mine = summary([(greedy(batch, 4096), batch)])["padded_fraction"]
        print(f"  {name:32s} greedy {mine:.4f}  logged {'-' if logged is None else f'{logged:.4f}'}")

    header = (f"{'workload':24s} {'budget':>6s} | {'greedy mb':>9s} {'padded':>7s} | {'DP mb':>6s} {'padded':>7s} | "
              f"{'tokens DP/greedy':>16s} | {'packed mb greedy/DP':>19s}")
    print("\n" + header + "\n" + "-" * len(header))
    for budget in args.budgets:
        shapes = [(f"recorded ({len(recorded)} steps)", [b for _, b, _ in recorded])]
        shapes += [(f"drawn {p} x {args.generations} ({args.draws})", drawn[p][: args.draws]) for p in args.prompts]
        for label, batches in shapes:
            numbers = compare(batches, budget)
            report["recorded" if label.startswith("recorded") else "drawn"][f"{label}@{budget}"] = numbers
            g, d, k = numbers["greedy"], numbers["dp"], numbers["packed"]
            same = "same" if k["same_plans"] else "differ"
            print(f"{label:24s} {budget:6d} | {g['micro_batches']:9.2f} {g['padded_fraction']:7.3f} | "
                  f"{d['micro_batches']:6.2f} {d['padded_fraction']:7.3f} | "
                  f"{d['computed_tokens'] / g['computed_tokens']:16.3f} | "
                  f"{k['greedy_micro_batches']:6.2f} / {k['dp_micro_batches']:.2f} {same}")

    if args.ranks:
        header = (f"{'ranks x workload':18s} {'budget':>6s} | {'forced':>6s} | {'own mb':>6s} {'padded':>6s} | "
                  f"{'parts':>5s} | {'split_into':>10s} {'padded':>6s} {'ms':>5s} | {'least total':>11s} "
                  f"{'padded':>6s} {'ms':>5s} | {'largest':>7s}")
        print("\nsharded ranks: each rank's own least-cost plan, then the ranks with fewer micro-batches cut into the "
              "agreed parts (tokens relative to the own plans; ms: a forced rank's cut)\n" + header + "\n"
              + "-" * len(header))
        for budget in args.budgets:
            for ranks in args.ranks:
                for p in args.prompts:
                    numbers = sharded(drawn[p][: args.draws * ranks], ranks, budget)
                    report["ranks"][f"{ranks} x {p} x {args.generations}@{budget}"] = numbers
                    own, a, b, f = numbers["own"], numbers["split_into"], numbers["least_total"], numbers["forced"]
                    # the least-total cut keeps split_into's largest cost (the memory peak) by construction
                    assert a["largest"] == b["largest"], (a, b)
                    print(f"{f'{ranks} x {p} x {args.generations}':18s} {budget:6d} | {f['share']:6.2f} | "
                          f"{own['micro_batches']:6.2f} {own['padded_fraction']:6.3f} | {a['micro_batches']:5.2f} | "
                          f"{a['computed_tokens'] / own['computed_tokens']:10.4f} {a['padded_fraction']:6.3f} "
                          f"{f['split_into_ms']:5.1f} | {b['computed_tokens'] / own['computed_tokens']:11.4f} "
                          f"{b['padded_fraction']:6.3f} {f['least_total_ms']:5.1f} | {a['largest']:7d}")

    print("\nplanning time of one drawn batch, best of 3 (ms): greedy cut / least-cost cut (10^9: a budget that never "
          "binds, the O(n^2) case)")
    sizes = (64, 256, 512)
    for budget in [*args.budgets, 10**9]:
        cells = []
        for rows in sizes:
            batch = drawn_batches(args, rows // args.generations, 1, random.Random(rows), pool)[0]
            g_s, d_s = plan_seconds(batch, budget)
            cells.append(f"{rows} rows {1e3 * g_s:6.2f} / {1e3 * d_s:7.2f}")
            report.setdefault("plan_ms", {})[f"{rows}@{budget}"] = {"greedy": 1e3 * g_s, "dp": 1e3 * d_s}
        print(f"  budget {budget:10d}: " + " | ".join(cells))
    if args.ranks:
        print("\none rank forced to more parts than it plans, larger batches: split_into against the least total "
              "(ms of the cut; tokens saved by the least total)")
        for budget in args.budgets:
            cells = []
            for rows in sizes:
                batch = drawn_batches(args, rows // args.generations, 1, random.Random(rows), pool)[0]
                own = len(plan_by_tokens(*batch, budget))
                for parts in sorted({min(rows, own + 1), min(rows, 2 * own)}):
                    clock = time.perf_counter()
                    a = split_into(*batch, parts)
                    a_ms = 1e3 * (time.perf_counter() - clock)
                    clock = time.perf_counter()
                    b = exact_parts_least_total(batch, parts)
                    b_ms = 1e3 * (time.perf_counter() - clock)
                    a_tokens, b_tokens = (sum(cost(run, batch) for run in cut) for cut in (a, b))
                    saved = (a_tokens - b_tokens) / a_tokens
                    report.setdefault("forced_at_scale", {})[f"{rows}@{budget}/{parts}"] = {
                        "own": own, "split_into_ms": a_ms, "least_total_ms": b_ms, "saved": saved}
                    cells.append(f"{rows} rows, {own} -> {parts} parts: {a_ms:5.1f} / {b_ms:6.1f} ms, {saved:6.2%}")
            print(f"  budget {budget:6d}: " + " | ".join(cells))
    print(f"\n{time.perf_counter() - start:.1f} s")
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
