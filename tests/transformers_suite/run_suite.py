#!/usr/bin/env python
"""Run transformers' own common model test suite against MHAR (all four residual modes) and, as the
control, against Llama, from a scratch copy of transformers' test files.

    python tests/transformers_suite/run_suite.py                 # everything, report in SCRATCH/report.md
    python tests/transformers_suite/run_suite.py --report /tmp/mhar-suite-report.md
    python tests/transformers_suite/run_suite.py --only full -k hidden_states   # one mode, a subset
    python tests/transformers_suite/run_suite.py --source HEAD   # mhar_hf as committed, not the working tree

Nothing of transformers' is committed to this repository. Everything this script writes goes under
SCRATCH (`--scratch`, or $MHAR_SUITE_DIR, default /tmp/mhar-transformers-suite), except the copy of
the report that `--report` asks for:

  SCRATCH/sdist/      transformers-<version>.tar.gz (pip download, the first time only; reused after)
  SCRATCH/site/       parameterized and pytest-timeout, which the suite needs (pip --target, first time)
  SCRATCH/upstream/   test files the sdist lacks, as a tree under tests/ (see UPSTREAM below); put
                      there by hand or fetched from GitHub at the release tag when that is reachable
  SCRATCH/tree/       rebuilt on every run: src/transformers and tests/ from the sdist, the upstream
                      files, our tester as tests/models/mhar/test_modeling_mhar.py, a conftest.py
  SCRATCH/results/    junit XML and pytest's log of the last run; SCRATCH/report.md
  SCRATCH/src/<sha>/  with --source REV: mhar_hf at that revision (git archive), tested instead of the
                      working tree

After the first run it works offline.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TESTER = HERE / "mhar_tester.py"

# Files transformers' sdist does not ship but the suite imports (paths under tests/). Each is taken
# from SCRATCH/upstream/tests/<path> if present, else fetched from the release tag on GitHub; the
# ones marked optional fall back to a small stand-in the script writes (see STANDINS).
UPSTREAM = {
    "causal_lm_tester.py": "required",
    "generation/test_utils.py": "required",
    "models/llama/test_modeling_llama.py": "required",
    "exporters/test_export.py": "optional",
    "utils/test_configuration_utils.py": "optional",
}

STANDINS = {
    # test_modeling_common only inherits these mixins; their torch.export tests then do not run
    "exporters/test_export.py": '''\
        """Stand-in written by MHAR's run_suite.py: transformers' tests/exporters/test_export.py is not in
        the sdist and was not found under SCRATCH/upstream; its torch.export tests are not run."""


        class ExportTesterMixin:
            pass


        class ExportGenerateTesterMixin:
            pass
        ''',
    # test_configuration_common imports only this dict from it (transformers 5.x's values)
    "utils/test_configuration_utils.py": '''\
        """Stand-in written by MHAR's run_suite.py: config_common_kwargs of transformers 5.x's
        tests/utils/test_configuration_utils.py, the one name test_configuration_common imports."""

        config_common_kwargs = {
            "return_dict": False,
            "output_hidden_states": True,
            "output_attentions": True,
            "dtype": "float16",
            "chunk_size_feed_forward": 5,
            "architectures": ["BertModel"],
            "id2label": {0: "label"},
            "label2id": {"label": "0"},
            "problem_type": "regression",
        }
        ''',
}

# Written into the scratch tree: registers MHAR as an in-tree model would be registered in the
# static auto tables that the common tests read (an `AutoModel.register` call does not reach them).
CONFTEST = '''\
"""Written by MHAR's run_suite.py (scratch only)."""

import mhar_hf  # noqa: F401  registers "mhar" with the Auto classes
from transformers.models.auto import modeling_auto

modeling_auto.MODEL_MAPPING_NAMES["mhar"] = "MHARModel"
modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["mhar"] = "MHARForCausalLM"
modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES["mhar"] = "MHARForSequenceClassification"
modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES["mhar"] = "MHARForQuestionAnswering"
modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES["mhar"] = "MHARForTokenClassification"

_MARKERS = (
    "generate", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test",
    "torch_export_test", "is_pipeline_test", "is_staging_test", "accelerate_tests", "agent_tests",
    "bitsandbytes", "training_ci", "tensor_parallel_ci", "not_device_test", "flaky", "slow",
)


def pytest_configure(config):
    for marker in _MARKERS:
        config.addinivalue_line("markers", marker)
    import os

    if os.environ.get("MHAR_SUITE_IMPORTED"):  # which mhar_hf the run imported, for the report
        with open(os.environ["MHAR_SUITE_IMPORTED"], "w") as out:
            out.write(os.path.dirname(mhar_hf.__file__))


def pytest_report_header(config):
    import transformers

    return [f"mhar_hf under test: {mhar_hf.__file__}", f"transformers: {transformers.__file__}"]
'''

LABELS = {  # junit classname suffix -> report label
    "MHARStandardModelTest": "standard",
    "MHARFullModelTest": "full",
    "MHARBlockModelTest": "block",
    "MHARDeltaModelTest": "delta",
    "LlamaModelTest": "llama (control)",
}
ORDER = ["llama (control)", "standard", "full", "block", "delta"]


def log(msg: str) -> None:
    print(f"[run_suite] {msg}", flush=True)


def transformers_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


def fetch_sdist(scratch: Path, version: str) -> Path:
    sdist_dir = scratch / "sdist"
    sdist = sdist_dir / f"transformers-{version}.tar.gz"
    if sdist.exists():
        return sdist
    sdist_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading the transformers {version} sdist into {sdist_dir}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"transformers=={version}", "-d", str(sdist_dir)], check=True)
    if not sdist.exists():
        raise SystemExit(f"pip download did not produce {sdist}")
    return sdist


def ensure_site(scratch: Path) -> Path:
    """parameterized (imported by the suite) and pytest-timeout, installed into SCRATCH/site only."""
    site = scratch / "site"
    wanted = {"parameterized": "parameterized", "pytest_timeout.py": "pytest-timeout"}
    missing = [pkg for path, pkg in wanted.items() if not (site / path).exists()]
    if missing:
        log(f"installing {', '.join(missing)} into {site}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                        *missing], check=True)
    return site


def upstream_file(scratch: Path, rel: str, version: str) -> str | None:
    path = scratch / "upstream" / "tests" / rel
    if path.exists():
        return path.read_text()
    url = f"https://raw.githubusercontent.com/huggingface/transformers/v{version}/tests/{rel}"
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            text = response.read().decode()
    except OSError:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log(f"fetched tests/{rel} from {url}")
    return text


def export_source(scratch: Path, rev: str) -> tuple[Path, str]:
    """mhar_hf at git revision `rev`, exported (read-only use of the repository) into SCRATCH/src/<sha>."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    dest = scratch / "src" / sha
    if not (dest / "mhar_hf" / "__init__.py").exists():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", sha, "mhar_hf"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest, f"{rev} ({sha[:10]})"


def build_tree(scratch: Path, sdist: Path, version: str) -> Path:
    tree = scratch / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    prefix = f"transformers-{version}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix + "tests/") or m.name.startswith(prefix + "src/transformers/")]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tree, members=members, filter="data")
    tests = tree / "tests"
    shipped = sorted(p.name for p in tests.glob("*.py"))
    log(f"sdist tests/: {len(shipped)} files ({', '.join(shipped[:6])}, ...)")

    for rel, need in UPSTREAM.items():
        dest = tests / rel
        if dest.exists():
            continue  # a later sdist may ship it
        text = upstream_file(scratch, rel, version)
        if text is None:
            if need == "required":
                raise SystemExit(
                    f"tests/{rel} is not in the sdist: put transformers v{version}'s copy at "
                    f"{scratch / 'upstream' / 'tests' / rel} (GitHub was not reachable)")
            text = textwrap.dedent(STANDINS[rel])
            log(f"tests/{rel}: not available, using a stand-in ({STANDINS[rel].splitlines()[0].strip()[:60]}...)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)

    # our tester, where an in-tree model's test would be
    mhar = tests / "models" / "mhar"
    mhar.mkdir(parents=True, exist_ok=True)
    shutil.copy(TESTER, mhar / "test_modeling_mhar.py")

    # packages for the relative imports, as in transformers' repository
    for d in [tests, *[p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
        (d / "__init__.py").touch()
    # the pipeline mixin reads the tiny-model summary at import; none here, so its tests skip
    summary = tests / "utils" / "tiny_model_summary.json"
    if not summary.exists():
        summary.write_text("{}\n")
    (tree / "conftest.py").write_text(CONFTEST)
    (tree / "pytest.ini").write_text("[pytest]\naddopts =\n")
    return tree


def run_pytest(scratch: Path, tree: Path, site: Path, source: Path, only: list[str], workers: str, timeout: int,
               extra: list[str]) -> tuple[Path, float]:
    results = scratch / "results"
    results.mkdir(exist_ok=True)
    junit = results / "junit.xml"
    targets = []
    if not only or "llama" in only:
        targets.append("tests/models/llama/test_modeling_llama.py")
    mhar_classes = {"standard": "MHARStandardModelTest", "full": "MHARFullModelTest",
                    "block": "MHARBlockModelTest", "delta": "MHARDeltaModelTest"}
    for mode, cls in mhar_classes.items():
        if not only or mode in only:
            targets.append(f"tests/models/mhar/test_modeling_mhar.py::{cls}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(source), str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MHAR_SUITE_IMPORTED"] = str(results / "mhar_hf_imported.txt")
    (results / "mhar_hf_imported.txt").unlink(missing_ok=True)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *targets, "-p", "no:cacheprovider", "-q", "-rfE",
           "--tb=short", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if workers not in ("0", ""):
        cmd += ["-n", workers]
    if timeout:
        cmd += [f"--timeout={timeout}"]
    cmd += extra
    log(f"cd {tree} && {' '.join(cmd)}")
    start = time.time()
    with open(results / "pytest.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            if re.match(r"^(FAILED|ERROR|=+ .* in [\d.]+s)", line):
                print(line, end="", flush=True)
        proc.wait()
    return junit, time.time() - start


def _cause(text: str) -> str:
    """One line that names a failure's cause: its exception line, addresses and numbers generalized."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = next((l for l in lines if re.match(r"^(E\s+)?[\w.]*(Error|Exception|Warning)\b", l)), lines[0] if lines else "")
    line = re.sub(r"^E\s+", "", line)
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"tensor\(.*", "tensor(…)", line)
    return line[:240]


def summarize(junit: Path, wall: float, version: str, source_label: str) -> str:
    root = ET.parse(junit).getroot()
    stats = {label: collections.Counter() for label in ORDER}
    failures = {label: collections.defaultdict(list) for label in ORDER}
    skips = {label: collections.Counter() for label in ORDER}
    for case in root.iter("testcase"):
        label = LABELS.get(case.get("classname", "").rsplit(".", 1)[-1])
        if label is None:
            continue
        name = case.get("name")
        stats[label]["ran"] += 1
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            stats[label]["failed"] += 1
            failures[label][_cause(failed.get("message", "") + "\n" + (failed.text or ""))].append(name)
        elif skipped is not None:
            stats[label]["skipped"] += 1
            skips[label][(skipped.get("message") or "").splitlines()[0][:160] if skipped.get("message") else ""] += 1
        else:
            stats[label]["passed"] += 1

    out = [f"# transformers {version} common model suite: MHAR (4 modes) and Llama (control), CPU", "",
           f"mhar_hf tested: {source_label}. Wall time: {wall / 60:.1f} min (pytest, all five classes together).",
           "`ran` counts every collected case (passed + failed + skipped; each parameterized case apart).", "",
           "| model | ran | passed | failed | skipped |", "|---|---|---|---|---|"]
    for label in ORDER:
        s = stats[label]
        if s["ran"]:
            out.append(f"| {label} | {s['ran']} | {s['passed']} | {s['failed']} | {s['skipped']} |")
    for label in ORDER:
        if not failures[label]:
            continue
        out += ["", f"## Failures: {label}", ""]
        for cause, names in sorted(failures[label].items(), key=lambda kv: -len(kv[1])):
            out.append(f"- **{len(names)}x** `{cause}`")
            out.append(f"  - {', '.join(sorted(names))}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", default=os.environ.get("MHAR_SUITE_DIR", "/tmp/mhar-transformers-suite"))
    parser.add_argument("--only", action="append", default=[],
                        help="standard, full, block, delta or llama; repeatable (default: all five)")
    parser.add_argument("-n", "--workers", default="2", help="pytest-xdist workers (0: none)")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds (0: none)")
    parser.add_argument("--report", help="also write the report to this path")
    parser.add_argument("--source", default="worktree",
                        help="mhar_hf to test: 'worktree' (this checkout, default) or a git revision such as HEAD")
    parser.add_argument("--build-only", action="store_true", help="build the scratch tree and stop")
    args, extra = parser.parse_known_args()

    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    version = transformers_version()
    sdist = fetch_sdist(scratch, version)
    site = ensure_site(scratch)
    tree = build_tree(scratch, sdist, version)
    if args.build_only:
        log(f"tree ready at {tree}")
        return
    if args.source == "worktree":
        source, source_label = REPO, f"working tree of {REPO}"
    else:
        source, source_label = export_source(scratch, args.source)
    log(f"testing mhar_hf from {source} ({source_label})")
    junit, wall = run_pytest(scratch, tree, site, source, args.only, args.workers, args.timeout, extra)
    imported_file = scratch / "results" / "mhar_hf_imported.txt"
    imported = imported_file.read_text().strip() if imported_file.exists() else "(unknown: pytest did not start)"
    report = summarize(junit, wall, version, f"{source_label}, imported from {imported}")
    (scratch / "report.md").write_text(report)
    if args.report:
        Path(args.report).write_text(report)
    print(report)
    log(f"report: {scratch / 'report.md'}; pytest log: {scratch / 'results' / 'pytest.log'}")


if __name__ == "__main__":
    main()
