"""The paired comparison: exact McNemar p-values against scipy and direct binomial sums,
hand-built runs with known outcomes, and runs that cannot be paired."""

import json
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest

from mhar_cli import main
from mhar_hf.compare import compare_runs, format_comparison, mcnemar_exact

TASK = "gsm8k_local"


def binomial_two_sided(b: int, c: int) -> float:
    """Exact binomial test of b successes in b + c trials at p = 1/2, two-sided, by summing the
    probabilities of every outcome no more likely than the observed one."""
    n = b + c
    if n == 0:
        return 1.0
    pmf = [Fraction(comb(n, k), 2**n) for k in range(n + 1)]
    return float(sum(p for p in pmf if p <= pmf[b]))


def write_run(folder: Path, outcomes: dict[int, bool], task: str = TASK, doc_hash=lambda i: f"doc{i}",
              primary=("exact_match", "strict-match")) -> Path:
    """A run folder as `mhar eval` writes it, with the given right/wrong outcome per item."""
    metric, filter_name = primary
    folder.mkdir(parents=True)
    accuracy = sum(outcomes.values()) / len(outcomes)
    results = {
        "results": {task: {f"{metric},{filter_name}": accuracy}},
        "n-shot": {task: 5}, "n-samples": {task: {"original": len(outcomes), "effective": len(outcomes)}},
        "mhar": {"model": str(folder), "tasks": [task], "primary": {task: {"metric": metric, "filter": filter_name}}},
    }
    (folder / "results.json").write_text(json.dumps(results))
    with open(folder / f"samples_{task}.jsonl", "w") as f:
        for doc_id, ok in outcomes.items():
            base = {"doc_id": doc_id, "doc_hash": doc_hash(doc_id), metric: float(ok)}
            f.write(json.dumps({**base, "filter": filter_name, "correct": ok}) + "\n")
            # the other filter's line, with the opposite outcome: compare must ignore it
            f.write(json.dumps({**base, "filter": "flexible-extract", metric: float(not ok), "correct": None}) + "\n")
    return folder


@pytest.mark.parametrize("b,c", [(0, 0), (0, 1), (1, 0), (3, 3), (0, 7), (2, 9), (10, 3), (25, 40), (60, 61), (1, 200)])
def test_mcnemar_exact_against_independent_references(b, c):
    from scipy.stats import binomtest

    p = mcnemar_exact(b, c)
    assert p == pytest.approx(binomial_two_sided(b, c), rel=1e-12)
    if b + c:
        assert p == pytest.approx(binomtest(b, b + c, 0.5).pvalue, rel=1e-9)
    assert mcnemar_exact(c, b) == p


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == 2 / 32  # only the two extreme outcomes are as extreme
    assert mcnemar_exact(1, 4) == pytest.approx(2 * 6 / 32)
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_hand_built_pair(tmp_path, capsys):
    a_right = {0, 1, 2, 3, 5, 8, 9, 11, 12, 13, 14, 15, 16, 17}  # 14 of 20
    b_right = {0, 2, 4, 6, 7, 12, 19}  # 7 of 20
    items = range(20)
    run_a = write_run(tmp_path / "a", {i: i in a_right for i in items})
    run_b = write_run(tmp_path / "b", {i: i in b_right for i in items})
    [paired] = compare_runs(run_a, run_b)
    only_a, only_b = len(a_right - b_right), len(b_right - a_right)
    assert (only_a, only_b) == (11, 4)
    assert (paired.items, paired.only_a, paired.only_b) == (20, only_a, only_b)
    assert (paired.accuracy_a, paired.accuracy_b) == (14 / 20, 7 / 20)
    assert paired.p_value == pytest.approx(binomial_two_sided(only_a, only_b))
    assert paired.metric == "exact_match (strict-match)"
    table = format_comparison([paired], run_a, run_b)
    assert f"| {TASK} | exact_match (strict-match) | 20 | 0.7000 | 0.3500 | 11 | 4 | {paired.p_value:.4g} |" in table

    assert main(["eval", "compare", str(run_a), str(run_b)]) == 0
    assert table in capsys.readouterr().out


def test_runs_that_do_not_pair_are_refused(tmp_path, capsys):
    base = write_run(tmp_path / "base", {i: i % 2 == 0 for i in range(10)})
    fewer = write_run(tmp_path / "fewer", {i: True for i in range(8)})  # another --limit
    with pytest.raises(ValueError, match="different items"):
        compare_runs(base, fewer)
    other_data = write_run(tmp_path / "other", {i: True for i in range(10)}, doc_hash=lambda i: f"x{i}")
    with pytest.raises(ValueError, match="item 0 differs"):
        compare_runs(base, other_data)
    other_task = write_run(tmp_path / "task", {i: True for i in range(10)}, task="gpqa_main_zeroshot_local",
                           primary=("acc", "none"))
    with pytest.raises(ValueError, match="share no task"):
        compare_runs(base, other_task)
    with pytest.raises(FileNotFoundError, match="results.json"):
        compare_runs(base, tmp_path / "nothing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text((base / "results.json").read_text())
    with pytest.raises(FileNotFoundError, match="incomplete"):
        compare_runs(base, tmp_path / "broken")

    assert main(["eval", "compare", str(base), str(fewer)]) == 2
    assert "different items" in capsys.readouterr().err
