"""Evaluation through the LM Evaluation Harness, with the paper's protocol as the default.

The paper's protocol is the harness's own task definitions: `gsm8k` (5-shot, exact match after
the `strict-match` filter) and `gpqa_main_zeroshot` (accuracy). Nothing is re-implemented here:
this module picks the tasks, runs them, and writes one *run folder*:

    RUN/results.json            the harness's results, configs, n-shot and n-samples, plus an
                                `mhar` block: model, tasks, each task's primary metric, limit...
    RUN/samples_<task>.jsonl    one line per item and filter (the harness's sample record) with
                                `correct` (the primary metric on that item) added
    RUN/tasks/                  the resolved local task files used (see below)

Offline use: `mhar_hf/tasks/` (package data) holds templates of tasks derived from the harness's own
(`include:` + a local data source). `${LM_EVAL_TASKS}` stands for the installed harness's
tasks folder and `${DATA_DIR}` for `data_dir`; each run writes resolved copies, with absolute
paths, into RUN/tasks/, so what ran is on record and the folder works with the plain
`lm_eval --include_path RUN/tasks` too. (The harness resolves relative `data_files` against
the working directory, not the YAML's folder: absolute paths avoid that trap.)

Each task runs in its own harness call with the same seeds, so an item's presentation (GPQA
shuffles the answer choices with Python's global RNG) depends only on the seed, never on which
other tasks ran: two runs of the same task are paired item by item (see `mhar_hf.compare`).
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import json
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import yaml

from .folder import EvalRecord, built_in_place

PAPER_TASKS = ("gsm8k", "gpqa_main_zeroshot")
TASK_TEMPLATES = Path(str(resources.files("mhar_hf") / "tasks"))  # package data
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


# --------------------------------------------------------------------------- task templates

class _Function(str):
    """A `!function module.name` reference in a task YAML, kept as text while rendering."""


class _TemplateLoader(yaml.SafeLoader):
    pass


class _TemplateDumper(yaml.SafeDumper):
    pass


_TemplateLoader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
_TemplateDumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def harness_tasks_dir() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent / "tasks"


def task_templates(folder: Path = TASK_TEMPLATES) -> dict[str, Path]:
    """Task name -> template file, for the templates in `folder`."""
    if not folder.is_dir():
        return {}
    found = {}
    for path in sorted(folder.glob("*.yaml")):
        config = yaml.load(path.read_text(), Loader=_TemplateLoader)
        if isinstance(config, dict) and isinstance(config.get("task"), str):
            found[config["task"]] = path
    return found


def _substitute(value, mapping: dict[str, str]):
    if isinstance(value, str):
        text = str(value)
        for key, replacement in mapping.items():
            text = text.replace(key, replacement)
        return type(value)(text) if isinstance(value, _Function) else text
    if isinstance(value, dict):
        return {key: _substitute(item, mapping) for key, item in value.items()}
    if isinstance(value, list):
        return [_substitute(item, mapping) for item in value]
    return value


def _data_files(config: dict) -> list[str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for value in files.values() for f in ([value] if isinstance(value, str) else value)]
    return list(files)


def render_task(template: Path, data_dir: str | os.PathLike | None, out_dir: Path) -> Path:
    """Write `template` with its placeholders resolved into `out_dir`; check its data files exist."""
    text = template.read_text()
    name = template.stem
    if "${DATA_DIR}" in text and data_dir is None:
        raise ValueError(f"task {name!r} reads local data files: pass --data-dir (the folder layout is "
                         f"described in {template})")
    mapping = {"${LM_EVAL_TASKS}": str(harness_tasks_dir())}
    if data_dir is not None:
        mapping["${DATA_DIR}"] = str(Path(data_dir).expanduser().resolve())
    config = _substitute(yaml.load(text, Loader=_TemplateLoader), mapping)
    missing = [f for f in _data_files(config) if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"task {config['task']!r}: data file {missing[0]} not found "
                                f"(expected layout: see {template})")
    include = config.get("include")
    if include and not Path(include).is_file():
        raise FileNotFoundError(f"task {config['task']!r} includes {include}, which the installed "
                                f"lm-eval does not have")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / template.name
    header = f"# Rendered by mhar eval from {template}; data and include paths resolved.\n"
    out.write_text(header + yaml.dump(config, Dumper=_TemplateDumper, sort_keys=False, allow_unicode=True))
    return out


def resolve_tasks(names: Sequence[str], tasks_dir: Path, data_dir=None, include_paths: Sequence = ()):
    """A harness TaskManager that knows every task in `names`.

    Local templates are rendered into `tasks_dir`; other names come from `include_paths` or
    the harness's built-in tasks (indexed only when needed: that costs ~10 s).
    """
    from lm_eval.tasks import TaskManager

    if not names:
        raise ValueError("no tasks given: pass --tasks, e.g. --tasks gsm8k,gpqa_main_zeroshot")
    for folder in include_paths:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"--include-path {folder} is not a folder")
    templates = task_templates()
    for name in names:
        if name in templates:
            render_task(templates[name], data_dir, tasks_dir)
    paths = [str(p) for p in ([tasks_dir] if tasks_dir.is_dir() else []) + list(include_paths)]
    manager = TaskManager(include_defaults=False, include_path=paths or None)
    if all(name in manager.all_tasks for name in names):
        return manager
    manager = TaskManager(include_defaults=True, include_path=paths or None)
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, list(templates) + manager.all_tasks, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown task {name!r}{hint} (local tasks: {', '.join(templates) or 'none'}; "
                             f"`lm_eval ls tasks` lists the harness's)")
    return manager


# --------------------------------------------------------------------------- running

def check_model_folder(path: str | os.PathLike) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass a folder written by save_pretrained")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise FileNotFoundError(f"{folder} has a config.json but no weights (*.safetensors or *.bin)")
    return folder


def primary_metric(task_config: dict) -> tuple[str, str]:
    """(metric, filter) a task reports first: the harness's own choice of headline number.

    For `gsm8k` that is exact_match after `strict-match`, for `gpqa_main_zeroshot` acc: the
    paper's protocol."""
    if not task_config.get("metric_list"):
        raise ValueError(f"task {task_config.get('task')!r} names no metric_list: mhar eval needs YAML tasks "
                         f"that list their metrics")
    metric = task_config["metric_list"][0]["metric"]
    filters = task_config.get("filter_list") or []
    return metric, (filters[0]["name"] if filters else "none")


def default_output(model_dir: Path) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return model_dir / "eval" / stamp


def task_sized_lm(**kwargs):
    """lm-eval's HFLM, whose length limit during generation is what the requests need (the
    longest prompt plus the tokens to generate) rather than the model's position limit. The
    harness's `auto` batch-size probe for generation runs batches of that many tokens: 131,072
    for a Llama-3.1 config, which exhausts any memory. No prompt is cut: the limit covers all."""
    from lm_eval.models.huggingface import HFLM

    class TaskSizedHFLM(HFLM):
        def generate_until(self, requests, disable_tqdm: bool = False):
            if not requests:
                return super().generate_until(requests, disable_tqdm)
            prompt = max(len(self.tok_encode(request.args[0])) for request in requests)
            new = max(request.args[1].get("max_gen_toks", self.max_gen_toks) for request in requests)
            limit, self._max_length = self._max_length, min(prompt + new, self.max_length)
            try:
                return super().generate_until(requests, disable_tqdm)
            finally:
                self._max_length = limit

    return TaskSizedHFLM(**kwargs)


def _parse_batch_size(value: str | int) -> str | int:
    if isinstance(value, int) or str(value).startswith("auto"):
        return value
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"--batch-size {value!r}: expected a positive integer or 'auto'") from None
    if size < 1:
        raise ValueError(f"--batch-size {value!r}: expected a positive integer or 'auto'")
    return size


@contextlib.contextmanager
def _without_git_record():
    """The harness records the working directory's git commit by running `git describe`, which
    prints "fatal: not a git repository" on the terminal outside one, once per task. The run
    folder does not keep that record, so the harness is spared asking."""
    import lm_eval.evaluator

    asks = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = asks


def evaluate(
    model_dir: str | os.PathLike,
    tasks: Sequence[str] = PAPER_TASKS,
    *,
    limit: int | None = None,
    batch_size: str | int = "auto",
    output: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
    include_paths: Sequence[str | os.PathLike] = (),
    device: str | None = None,
    max_gen_toks: int | None = None,
    seed: int = 0,
    report=print,
) -> Path:
    """Run `tasks` on the model in `model_dir` and write a run folder; returns its path.

    `limit` evaluates the first N items of each task (smoke runs; not for reported numbers).
    `max_gen_toks` caps generated tokens (the harness default, 256, is the protocol).
    """
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable, make_table

    import mhar_hf  # registers the MHAR classes with the Auto factories the harness uses

    model_dir = check_model_folder(model_dir).resolve()
    out = Path(output) if output is not None else default_output(model_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output folder {out} exists and is not empty: choose another --output")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit {limit}: expected a positive number of items")
    batch_size = _parse_batch_size(batch_size)
    tasks = list(dict.fromkeys(tasks))

    with built_in_place(out, "evaluating", report) as partial:
        manager = resolve_tasks(tasks, partial / "tasks", data_dir, include_paths)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if str(batch_size).startswith("auto") and torch.device(device).type == "cpu":
            # the probe finds a CPU's limit by running out of memory, which on a CPU ends the process
            report("--batch-size auto on a CPU: evaluating one item at a time (pass a number to batch)")
            batch_size = 1
        lm = task_sized_lm(pretrained=str(model_dir), backend="causal", batch_size=batch_size, device=device,
                           dtype="auto")
        merged: dict = {}
        primary = {}
        for task in tasks:
            # One harness call per task, same seeds: an item's presentation never depends on
            # which other tasks ran, so runs of one task pair up item by item.
            try:
                with _without_git_record():
                    result = simple_evaluate(
                        lm, tasks=[task], task_manager=manager, limit=limit, log_samples=True,
                        gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None,
                        random_seed=seed, numpy_random_seed=seed + 1234, torch_random_seed=seed + 1234,
                        fewshot_random_seed=seed + 1234,
                    )
            except ConnectionError as error:  # the model is loaded: only a dataset download is left
                raise FileNotFoundError(
                    f"task {task!r}: its dataset could not be fetched ({error}). Offline, run the local "
                    f"variants on your copies of the files: --tasks gsm8k_local,gpqa_main_zeroshot_local "
                    f"--data-dir DATA (see evaluation/README.md)") from error
            for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
                merged.setdefault(key, {}).update(result.get(key, {}))
            for name, samples in result["samples"].items():
                metric, filter_name = primary[name] = primary_metric(result["configs"][name])
                with open(partial / f"samples_{name}.jsonl", "w") as f:
                    for sample in samples:
                        value = sample.get(metric) if sample.get("filter") == filter_name else None
                        line = {**sample, "correct": None if value is None else float(value) == 1.0}
                        f.write(json.dumps(line, default=handle_non_serializable, ensure_ascii=False) + "\n")
        config = json.loads((model_dir / "config.json").read_text())
        record = EvalRecord(
            model=str(model_dir),
            model_type=config.get("model_type"),
            tasks=list(primary),
            primary={name: {"metric": m, "filter": f} for name, (m, f) in primary.items()},
            limit=limit,
            data_dir=str(Path(data_dir).resolve()) if data_dir is not None else None,
            max_gen_toks=max_gen_toks,
            seed=seed,
            batch_size=str(batch_size),
            mhar_hf_version=mhar_hf.__version__,
            lm_eval_version=_version("lm_eval"),
        )
        record.write(partial, merged, default=handle_non_serializable)
    report(make_table(merged))
    report(f"run folder: {out}")
    return out


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
