"""Paired comparison of two evaluation runs on the same items, with the exact McNemar test.

Both runs score the same items, so the only informative items are the discordant ones: `b`
right in A only, `c` right in B only. Under the null hypothesis (equal accuracy) each
discordant item falls either way with probability 1/2, so the exact two-sided p-value is
`min(1, 2 * P(X <= min(b, c)))` with `X ~ Binomial(b + c, 1/2)`, computed with exact integers.

Runs are folders written by `mhar_hf.evaluate.evaluate`: `results.json` names each task's
primary metric and `samples_<task>.jsonl` holds the per-item `correct` flags.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from .folder import EvalRecord


@dataclass(frozen=True)
class PairedResult:
    task: str
    metric: str
    items: int
    accuracy_a: float
    accuracy_b: float
    only_a: int  # items right in A and wrong in B
    only_b: int  # items right in B and wrong in A
    p_value: float


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value from the two discordant counts."""
    if only_a < 0 or only_b < 0:
        raise ValueError("discordant counts must be non-negative")
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = Fraction(sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail))


def load_run(path: str | os.PathLike) -> dict:
    """A run folder's results.json, with its per-item outcomes: {task: {doc_id: (doc_hash, correct)}}."""
    folder = Path(path)
    record, _ = EvalRecord.read_run(folder)
    items = {}
    for task, primary in record.primary.items():
        samples_file = folder / f"samples_{task}.jsonl"
        if not samples_file.is_file():
            raise FileNotFoundError(f"{samples_file} not found: the run folder is incomplete")
        outcomes = {}
        with open(samples_file) as f:
            for line in f:
                sample = json.loads(line)
                if sample.get("filter") != primary["filter"]:
                    continue
                if sample.get("correct") is None:
                    raise ValueError(f"{samples_file}: item {sample['doc_id']} has no right/wrong outcome "
                                     f"({primary['metric']} is not a 0/1 metric)")
                outcomes[sample["doc_id"]] = (sample["doc_hash"], bool(sample["correct"]))
        items[task] = outcomes
    return {"path": folder, "record": record, "items": items}


def compare_runs(run_a: str | os.PathLike, run_b: str | os.PathLike) -> list[PairedResult]:
    """One PairedResult per task both runs evaluated; the items of each must be the same."""
    a, b = load_run(run_a), load_run(run_b)
    tasks = [task for task in a["items"] if task in b["items"]]
    if not tasks:
        raise ValueError(f"the runs share no task: {run_a} has {sorted(a['items'])}, "
                         f"{run_b} has {sorted(b['items'])}")
    paired = []
    for task in tasks:
        items_a, items_b = a["items"][task], b["items"][task]
        if items_a.keys() != items_b.keys():
            only = sorted(items_a.keys() ^ items_b.keys())
            raise ValueError(f"task {task}: the runs scored different items ({len(items_a)} vs {len(items_b)} "
                             f"items; item {only[0]} is in one run only): evaluate both with the same "
                             f"data and --limit")
        changed = [doc for doc in items_a if items_a[doc][0] != items_b[doc][0]]
        if changed:
            raise ValueError(f"task {task}: item {changed[0]} differs between the runs ({len(changed)} items "
                             f"differ): evaluate both on the same data files with the same seed")
        only_a = sum(items_a[d][1] and not items_b[d][1] for d in items_a)
        only_b = sum(items_b[d][1] and not items_a[d][1] for d in items_a)
        n = len(items_a)
        paired.append(PairedResult(
            task=task,
            metric="{metric} ({filter})".format(**a["record"].primary[task]),
            items=n,
            accuracy_a=sum(ok for _, ok in items_a.values()) / n,
            accuracy_b=sum(ok for _, ok in items_b.values()) / n,
            only_a=only_a,
            only_b=only_b,
            p_value=mcnemar_exact(only_a, only_b),
        ))
    return paired


def format_comparison(paired: list[PairedResult], run_a, run_b) -> str:
    """A Markdown table of the paired results."""
    lines = [f"A: {run_a}", f"B: {run_b}", "",
             "| task | metric | items | A | B | right in A only | right in B only | McNemar p (exact) |",
             "|---|---|--:|--:|--:|--:|--:|--:|"]
    for r in paired:
        lines.append(f"| {r.task} | {r.metric} | {r.items} | {r.accuracy_a:.4f} | {r.accuracy_b:.4f} | "
                     f"{r.only_a} | {r.only_b} | {r.p_value:.4g} |")
    return "\n".join(lines)
