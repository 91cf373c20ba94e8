#!/usr/bin/env bash
# One GPU session of the experiments: build the corpus, train arms, collect the results.
#
#   experiments/run_on_gpu.sh MINUTES OUT TRAIN_ARMS_OPTIONS... ARM...
#
# Everything is under /tmp/mhar-experiments (corpus/, runs/); OUT gets results.tgz (the collected
# results/ folder and the page regenerated from it) and logs.tgz (init.log and each arm's train.log). No piece
# starts, and a running piece is stopped, MINUTES after the start less a minute for collecting.
# $CORPUS_OPTIONS, if set, goes to build_corpus.py (e.g. a small --root for a dry run on a CPU).
set -uo pipefail
minutes=$1 out=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
work=/tmp/mhar-experiments
deadline=$(python3 -c "import time; print(int(time.time() + $minutes * 60 - 60))")
mkdir -p "$out" "$work"
python3 "$here/build_corpus.py" --out "$work/corpus" ${CORPUS_OPTIONS:-} || exit 1
python3 "$here/train_arms.py" --corpus "$work/corpus" --runs "$work/runs" --deadline "$deadline" "$@"
status=$?
python3 "$here/report.py" --collect "$work/runs" --corpus "$work/corpus" --results "$work/results" --out "$work/results/results.md"
tar czf "$out/results.tgz" -C "$work" results
(cd "$work/runs" && tar czf "$out/logs.tgz" init.log */train.log)
exit $status
