"""`mhar eval` and the harness, offline: both paper tasks on a tiny local model and synthetic
files in the original formats; the plain `lm_eval` CLI through the remote-code bundle; bad input."""

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S

from mhar_cli import main
from mhar_hf.compare import compare_runs

GSM8K_TRAIN = [(3, 4), (5, 6), (2, 9), (7, 8), (4, 4), (6, 3)]
GSM8K_TEST = [(8, 7), (9, 2), (3, 11), (12, 5)]
# (question, correct, three wrong answers). Answers that pandas would turn into numbers ("0.50",
# "007") must reach the prompt as written.
GPQA_ROWS = [
    ("A crate holds 4 jars of 0.25 litres. Half the crate is poured out. How many litres remain?",
     "0.50", "0.5 litres less", "1", "2"),
    ("Agent numbers count up from 1, padded to three digits. Which agent is seventh?", "007", "7", "070", "700"),
    ("A train leaves at 3 pm and travels 4 hours. When does it arrive?", "7 pm", "6 pm", "8 pm", "1 pm"),
    ("A farmer has 5 rows of 6 leeks. How many leeks?", "30", "11", "25", "36"),
    ("A bag of 12 marbles is split among 3 children. How many each?", "4", "3", "6", "9"),
]
LOCAL_TASKS = ["gsm8k_local", "gpqa_main_zeroshot_local"]
LIMIT = 3


def write_gsm8k(folder: Path) -> None:
    folder.mkdir(parents=True)
    for name, pairs in (("train", GSM8K_TRAIN), ("test", GSM8K_TEST)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for a, b in pairs:
                question = f"Mia packs {a} boxes with {b} pencils each. How many pencils does she pack?"
                answer = f"Each box holds {b} pencils, so {a} boxes hold {a}*{b}=<<{a}*{b}={a * b}>>{a * b}.\n#### {a * b}"
                f.write(json.dumps({"question": question, "answer": answer}) + "\n")


def write_gpqa(folder: Path) -> None:
    folder.mkdir(parents=True)
    columns = ["Record ID", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
               "Incorrect Answer 3", "Explanation"]
    with open(folder / "gpqa_main.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for i, row in enumerate(GPQA_ROWS):
            writer.writerow([f"rec{i}", *row, "invented for the test"])


def save_tiny(path: Path, tokenizer, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    from mhar_hf import save_remote_code
    from mhar_hf.tiny import tiny_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tokenizer), residual_mode="full"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_remote_code(path)
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("eval")
    write_gsm8k(root / "data" / "gsm8k")
    write_gpqa(root / "data" / "gpqa")
    return {"root": root, "data": root / "data", "model_a": save_tiny(root / "model_a", tokenizer, seed=0),
            "model_b": save_tiny(root / "model_b", tokenizer, seed=1)}


@pytest.fixture(scope="module")
def run_a(workspace):
    from mhar_hf.evaluate import evaluate

    return evaluate(workspace["model_a"], LOCAL_TASKS, limit=LIMIT, batch_size=4, data_dir=workspace["data"],
                    output=workspace["root"] / "run_a", max_gen_toks=8, report=lambda _: None)


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def strict_match(response: str, answer: str) -> bool:
    """GSM8K strict-match, written from the task's definition: the first `#### N` of the
    response against the reference's, ignoring case, commas, `$` and a final period."""
    found = re.search(r"#### (\-?[0-9\.\,]+)", response)
    if not found:
        return False
    clean = lambda text: re.sub(r"\.$", "", text.replace(",", "").replace("$", "")).lower()  # noqa: E731
    return clean(found.group(1)) == clean(answer.split("#### ")[-1])


def test_run_folder_follows_the_paper_protocol(run_a, workspace):
    results = json.loads((run_a / "results.json").read_text())
    info = results["mhar"]
    assert info["model"] == str(workspace["model_a"].resolve())
    assert info["primary"] == {"gsm8k_local": {"metric": "exact_match", "filter": "strict-match"},
                               "gpqa_main_zeroshot_local": {"metric": "acc", "filter": "none"}}
    assert results["n-shot"] == {"gsm8k_local": 5, "gpqa_main_zeroshot_local": 0}
    assert {task: n["effective"] for task, n in results["n-samples"].items()} == {t: LIMIT for t in LOCAL_TASKS}
    # The resolved task files point at the data with absolute paths and work from any folder.
    rendered = (run_a / "tasks" / "gsm8k_local.yaml").read_text()
    assert str((workspace["data"] / "gsm8k" / "test.jsonl").resolve()) in rendered
    assert "${" not in rendered
    assert not list(run_a.parent.glob(".run_a.partial-*"))

    samples = read_samples(run_a / "samples_gsm8k_local.jsonl")
    assert sorted((s["doc_id"], s["filter"]) for s in samples) == sorted(
        (i, f) for i in range(LIMIT) for f in ("strict-match", "flexible-extract"))
    train_questions = {f"Mia packs {a} boxes" for a, _ in GSM8K_TRAIN}
    for sample in samples:
        prompt = sample["arguments"][0][0]
        a, b = GSM8K_TEST[sample["doc_id"]]
        assert prompt.endswith(f"Question: Mia packs {a} boxes with {b} pencils each. How many pencils does she pack?\nAnswer:")
        shots = re.findall(r"Question: (Mia packs \d+ boxes)", prompt)[:-1]
        assert len(shots) == 5 and set(shots) <= train_questions  # 5-shot, from the train file


def test_per_item_outcomes_match_an_independent_scoring(run_a):
    results = json.loads((run_a / "results.json").read_text())
    gsm8k = [s for s in read_samples(run_a / "samples_gsm8k_local.jsonl") if s["filter"] == "strict-match"]
    for sample in gsm8k:
        assert sample["correct"] == strict_match(sample["resps"][0][0], sample["target"])
    assert results["results"]["gsm8k_local"]["exact_match,strict-match"] == pytest.approx(
        sum(s["correct"] for s in gsm8k) / LIMIT)

    gpqa = read_samples(run_a / "samples_gpqa_main_zeroshot_local.jsonl")
    assert len(gpqa) == LIMIT
    for sample in gpqa:
        doc = sample["doc"]
        question, correct, *wrong = GPQA_ROWS[sample["doc_id"]]
        assert doc["Correct Answer"] == correct and [doc[f"Incorrect Answer {i}"] for i in (1, 2, 3)] == wrong
        choices = [doc[f"choice{i}"] for i in (1, 2, 3, 4)]
        assert sorted(choices) == sorted([correct, *wrong])
        assert sample["target"] == f"({'ABCD'[choices.index(correct)]})"
        loglikelihoods = [resp[0][0] for resp in sample["resps"]]
        best = max(range(4), key=loglikelihoods.__getitem__)
        assert sample["correct"] == (best == "ABCD".index(sample["target"][1]))
    assert results["results"]["gpqa_main_zeroshot_local"]["acc,none"] == pytest.approx(
        sum(s["correct"] for s in gpqa) / LIMIT)


def test_runs_of_one_task_pair_up_whatever_else_ran(run_a, workspace, capsys):
    """GPQA shuffles choices with the global RNG: run B evaluates GPQA alone, yet its items
    (choice order included) are run A's, and compare reproduces an independent McNemar test."""
    run_b = workspace["root"] / "run_b"
    code = main(["eval", str(workspace["model_b"]), "--tasks", "gpqa_main_zeroshot_local", "--limit", str(LIMIT),
                 "--batch-size", "2", "--data-dir", str(workspace["data"]), "--output", str(run_b)])
    assert code == 0
    a = {s["doc_id"]: s for s in read_samples(run_a / "samples_gpqa_main_zeroshot_local.jsonl")}
    b = {s["doc_id"]: s for s in read_samples(run_b / "samples_gpqa_main_zeroshot_local.jsonl")}
    assert {i: s["arguments"] for i, s in a.items()} == {i: s["arguments"] for i, s in b.items()}
    [paired] = compare_runs(run_a, run_b)  # gsm8k is in run A only: not compared
    only_a = sum(a[i]["correct"] and not b[i]["correct"] for i in a)
    only_b = sum(b[i]["correct"] and not a[i]["correct"] for i in a)
    n = only_a + only_b
    expected_p = min(1.0, 2 * sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n) if n else 1.0
    assert (paired.task, paired.items, paired.only_a, paired.only_b) == ("gpqa_main_zeroshot_local", LIMIT, only_a, only_b)
    assert paired.p_value == pytest.approx(expected_p)
    capsys.readouterr()
    assert main(["eval", "compare", str(run_a), str(run_b)]) == 0
    assert "gpqa_main_zeroshot_local" in capsys.readouterr().out


def test_plain_lm_eval_cli_loads_the_folder_through_remote_code(run_a, workspace, tmp_path):
    """`lm_eval --model hf` on an MHAR folder (the stock CLI, loading the bundled modeling code):
    same items and the same greedy answers as `mhar eval`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "--model", "hf",
               "--model_args", f"pretrained={workspace['model_a']},trust_remote_code=True",
               "--tasks", "gsm8k_local", "--include_path", str(run_a / "tasks"), "--limit", str(LIMIT),
               "--device", "cpu", "--batch_size", "4", "--gen_kwargs", "max_gen_toks=8",
               "--output_path", str(tmp_path / "out"), "--log_samples"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    [samples_file] = (tmp_path / "out").rglob("samples_gsm8k_local_*.jsonl")
    theirs = {(s["doc_id"], s["filter"]): s["resps"] for s in read_samples(samples_file)}
    ours = {(s["doc_id"], s["filter"]): s["resps"] for s in read_samples(run_a / "samples_gsm8k_local.jsonl")}
    assert theirs == ours


def test_include_path_adds_a_task_folder(workspace, tmp_path):
    """A user's own lm-eval task folder, used as lm-eval's --include_path uses it."""
    from mhar_hf.evaluate import evaluate, harness_tasks_dir

    folder = tmp_path / "my_tasks"
    folder.mkdir()
    (folder / "arith.yaml").write_text(
        f"include: {harness_tasks_dir() / 'gsm8k' / 'gsm8k.yaml'}\ntask: my_arith\ntag: []\ndataset_path: json\n"
        f"dataset_name: null\nnum_fewshot: 2\ndataset_kwargs:\n  data_files:\n"
        f"    train: {workspace['data'] / 'gsm8k' / 'train.jsonl'}\n    test: {workspace['data'] / 'gsm8k' / 'test.jsonl'}\n")
    run = evaluate(workspace["model_a"], ["my_arith"], limit=2, batch_size=2, include_paths=[folder],
                   output=tmp_path / "run", max_gen_toks=4, report=lambda _: None)
    results = json.loads((run / "results.json").read_text())
    assert results["n-shot"] == {"my_arith": 2} and results["n-samples"]["my_arith"]["effective"] == 2
    assert not (run / "tasks").exists()


def test_a_run_outside_a_git_repository_prints_no_git_error(workspace, tmp_path, monkeypatch, capfd):
    """The harness asks git for the working directory's commit; outside a repository git's
    complaint reached the terminal once per task (the demo run from a home folder showed four)."""
    from mhar_hf.evaluate import evaluate

    monkeypatch.chdir(tmp_path)
    evaluate(workspace["model_a"], ["gsm8k_local"], limit=1, batch_size=1, data_dir=workspace["data"],
             output=tmp_path / "run", max_gen_toks=1, report=lambda _: None)
    assert (tmp_path / "run" / "results.json").exists()
    assert "not a git repository" not in capfd.readouterr().err


def test_unknown_task_is_named_with_suggestions(workspace, capsys):
    code = main(["eval", str(workspace["model_a"]), "--tasks", "gsm8k_locl", "--data-dir", str(workspace["data"]),
                 "--output", str(workspace["root"] / "unknown")])
    error = capsys.readouterr().err
    assert code == 2 and "unknown task 'gsm8k_locl'" in error and "gsm8k_local" in error
    assert not (workspace["root"] / "unknown").exists()


def test_missing_data_file_and_missing_data_dir(workspace, tmp_path, capsys):
    partial = tmp_path / "data"
    write_gsm8k(partial / "gsm8k")  # no gpqa file
    out = tmp_path / "run"
    code = main(["eval", str(workspace["model_a"]), "--tasks", "gsm8k_local,gpqa_main_zeroshot_local",
                 "--data-dir", str(partial), "--output", str(out)])
    error = capsys.readouterr().err
    assert code == 2 and "gpqa_main.csv not found" in error
    assert not out.exists() and not list(tmp_path.glob(".run.partial-*"))
    code = main(["eval", str(workspace["model_a"]), "--tasks", "gsm8k_local", "--output", str(out)])
    assert code == 2 and "pass --data-dir" in capsys.readouterr().err


def test_folder_without_a_model(workspace, tmp_path, capsys):
    assert main(["eval", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text((workspace["model_a"] / "config.json").read_text())
    assert main(["eval", str(tmp_path)]) == 2
    assert "no weights" in capsys.readouterr().err


def test_output_folder_must_be_new_and_arguments_are_checked(workspace, run_a, capsys):
    assert main(["eval", str(workspace["model_a"]), "--tasks", "gsm8k_local", "--output", str(run_a)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["eval", str(workspace["model_a"]), "--batch-size", "zero", "--output", str(run_a.parent / "x")]) == 2
    assert "--batch-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "compare", str(run_a)])
    with pytest.raises(SystemExit):
        main(["eval", "compare", str(run_a), str(run_a), "--limit", "3"])
    with pytest.raises(SystemExit):
        main(["eval", str(workspace["model_a"]), str(run_a)])


def test_generation_batch_probe_is_sized_by_the_requests(workspace, tokenizer, tmp_path, monkeypatch):
    """lm-eval's `auto` probe runs batches of the model's length limit; with a Llama-3.1-style
    131,072-position config that exhausts memory. The probe must see what the prompts need."""
    from lm_eval.api.instance import Instance
    from transformers import AutoModelForCausalLM

    from mhar_hf.evaluate import task_sized_lm
    from mhar_hf.tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=131072))
    model.save_pretrained(tmp_path / "long")
    tokenizer.save_pretrained(tmp_path / "long")
    lm = task_sized_lm(pretrained=str(tmp_path / "long"), backend="causal", batch_size="auto", device="cpu")
    probed = []

    def probe(self, requests=None, pos=0):
        probed.append(self.max_length)
        return 2

    monkeypatch.setattr(type(lm), "_detect_batch_size", probe)
    prompts = ["Mia packs three boxes.", "A farmer has five rows of six leeks, and a crate holds four jars."]
    requests = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}), i)
                for i, p in enumerate(prompts)]
    outputs = lm.generate_until(requests)
    assert len(outputs) == 2 and lm.max_length == 131072  # the limit is back once the requests are done
    assert probed == [max(len(lm.tok_encode(p)) for p in prompts) + 4]


def test_auto_batch_size_on_a_cpu_evaluates_one_item_at_a_time(workspace, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from mhar_hf.evaluate import evaluate

    monkeypatch.setattr(HFLM, "_detect_batch_size", lambda *a, **k: pytest.fail("the probe ran on a CPU"))
    notes = []
    run = evaluate(workspace["model_a"], ["gsm8k_local"], limit=1, batch_size="auto", data_dir=workspace["data"],
                   output=tmp_path / "run", max_gen_toks=4, device="cpu", report=notes.append)
    assert json.loads((run / "results.json").read_text())["mhar"]["batch_size"] == "1"
    assert any("one item at a time" in note for note in notes)


def test_a_refused_or_failed_run_leaves_nothing(workspace, tmp_path, monkeypatch):
    """No empty MODEL/eval/ after a failure, and no staging folder; one left by a killed run
    (a process that no longer runs) is removed by the next."""
    from mhar_hf import evaluate as evaluate_module

    model = tmp_path / "model"
    model.mkdir()
    for item in workspace["model_a"].iterdir():
        (model / item.name).symlink_to(item)
    assert main(["eval", str(model), "--tasks", "no_such_task", "--data-dir", str(workspace["data"])]) == 2
    assert not (model / "eval").exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    from mhar_hf.folder import _this_host

    leftover = tmp_path / "runs" / f".run.evaluating-{_this_host()}-{int(dead.stdout)}-abc"
    leftover.mkdir(parents=True)
    monkeypatch.setattr(evaluate_module, "resolve_tasks", lambda *a: (_ for _ in ()).throw(ValueError("stop")))
    with pytest.raises(ValueError, match="stop"):
        evaluate_module.evaluate(model, ["gsm8k_local"], output=tmp_path / "runs" / "run", report=lambda _: None)
    assert list((tmp_path / "runs").iterdir()) == []
