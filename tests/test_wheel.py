"""The package as a user installs it: a wheel built from this checkout, installed outside it, runs
`mhar demo` to the end (conversion, evaluation with the shipped task files, the model card from
the shipped template) without reading anything from the repository."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]


def test_a_wheel_installed_outside_the_checkout_runs_the_demo(tmp_path):
    source = tmp_path / "source"  # setuptools builds in the source folder: a copy keeps the checkout clean
    for package in ("mhar_hf", "mhar_cli"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
                           timeout=HANG_GUARD_S)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mhar_hf-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"mhar_hf/templates/model_card.md.j2", "mhar_hf/tasks/gsm8k_local.yaml", "mhar_hf/demo/corpus.txt"} <= set(names)

    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # the installed copy comes first on the path; the checkout's own files are not on it
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = tmp_path / "elsewhere"
    where.mkdir()
    demo = subprocess.run([sys.executable, "-c", "import sys, mhar_hf, mhar_cli; print(mhar_hf.__file__); "
                           "sys.exit(mhar_cli.main(['demo', '--workdir', 'demo']))"],
                          cwd=where, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-4000:]
    assert demo.stdout.splitlines()[0].startswith(str(site))
    assert (where / "demo").is_dir() and list((where / "demo").rglob("README.md"))
