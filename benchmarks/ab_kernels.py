"""The routing kernels of this tree against those of another git revision, side by side in one run.

    python benchmarks/ab_kernels.py --base HEAD~2
    python benchmarks/ab_kernels.py --base HEAD~2 --presets 1B --modes full --on-step

Loads `mhar_hf/ops/routing/kernels.py` as it is at --base, and only that file: the launches stay
this tree's (`launch.py`, `reads.py`, ...), so the base's kernels must take the same arguments. Per preset and mode
(H = 8) it times every routing kernel's GPU time in one step's reads with the base's kernels and
with this tree's, and with --on-step also the whole training step with each (`fused+graph`, as
bench_train.py times it) and the plain model's compiled+graph step for the ratios. A change to the
kernels alone is checked this way in one GPU call, on one card. Each line printed is also a row of
`results/ab_kernels.jsonl` (`results_log.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import subprocess
import tempfile
from pathlib import Path

import torch

from bench_train import MICRO_BATCH, copy_bandwidth, time_routing
from mhar_hf import MHARConfig
from mhar_hf.ops.routing import kernels
from results_log import append_result, utc_now
from sweep_launch import model_sites, step_ms

KERNELS = "mhar_hf/ops/routing/kernels.py"
REPO = Path(__file__).resolve().parents[1]


def base_kernels(revision: str, folder: Path, repo: Path = REPO):
    """The kernels module as it is at `revision` of `repo`, written to `folder` (Triton reads a
    kernel's source from its file) and imported under a name of its own."""
    shown = subprocess.run(["git", "show", f"{revision}:{KERNELS}"], cwd=repo, capture_output=True, text=True)
    if shown.returncode:
        raise SystemExit(f"--base {revision}: git cannot show {KERNELS} there ({shown.stderr.strip()})")
    path = folder / "kernels_base.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("mhar_base_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git_commit_of(revision: str, repo: Path = REPO) -> str:
    """The short hash git gives `revision` (the name itself if git cannot resolve it)."""
    found = subprocess.run(["git", "rev-parse", "--short", revision], cwd=repo, capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else revision


@contextlib.contextmanager
def kernels_of(module):
    """The fused op launches `module`'s kernels inside the block, this tree's again after it."""
    current = {name: getattr(kernels, name) for name in kernels.ENTRY_POINTS}
    for name in current:
        setattr(kernels, name, getattr(module, name))
    try:
        yield
    finally:
        for name, kernel in current.items():
            setattr(kernels, name, kernel)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision whose kernels.py to time against this tree's")
    parser.add_argument("--presets", nargs="+", default=["350M", "1B"], choices=list(MICRO_BATCH))
    parser.add_argument("--modes", nargs="+", default=["full", "delta", "block"], choices=["full", "block", "delta"])
    parser.add_argument("--on-step", action="store_true", help="also the training step with each version")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ab_kernels.py needs a CUDA GPU")
    began, base = utc_now(), git_commit_of(args.base)
    with tempfile.TemporaryDirectory() as folder:
        versions = {f"base {args.base}": base_kernels(args.base, Path(folder)), "this tree": kernels}
        bandwidth = copy_bandwidth()
        for preset in args.presets:
            config = MHARConfig.from_preset(preset)
            batch, seq = MICRO_BATCH[preset]
            plain = step_ms(preset, "standard") if args.on_step else None
            for mode in args.modes:
                sites = model_sites(preset, mode)
                for label, module in versions.items():
                    with kernels_of(module):
                        figures = time_routing(sites, mode == "delta", batch * seq, config.hidden_size, 8, bandwidth)
                        step = step_ms(preset, mode) if plain is not None else None
                    line = f"{preset} {mode} {label}: {figures['fwd_bwd_ms']} ms of routing kernels"
                    if step is not None:
                        line += f", step {step:.2f} ms ({plain / step:.4f}x plain)"
                    print(f"{line} {figures['fwd_bwd_kernels_ms']}", flush=True)
                    append_result("ab_kernels", dict(preset=preset, mode=mode, heads=8, base=base,
                                                     kernels="this tree" if label == "this tree" else "base"),
                                  dict(fwd_bwd_ms=figures["fwd_bwd_ms"], kernels_ms=figures["fwd_bwd_kernels_ms"],
                                       step_ms=step, plain_step_ms=plain), date=began)


if __name__ == "__main__":
    main()
