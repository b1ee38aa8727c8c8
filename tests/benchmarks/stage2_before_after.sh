#!/bin/bash
# Every stage-2 benchmark against an older tree, alternating, on the same caches (issue 37's
# "before and after" table in docs/performance.md; about 10 minutes on 2 cores):
#   git worktree add /tmp/before <commit>
#   bash tests/benchmarks/stage2_before_after.sh /tmp/before > before_after.log
# Caches are built once under $WORK (default /tmp/stage2-bench) and kept for both trees.
set -u
BEFORE=${1:?usage: stage2_before_after.sh PATH_OF_OLDER_TREE}
WORK=${WORK:-/tmp/stage2-bench}
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
run() { echo "=== $1 $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; shift; "$@" 2>&1; }
after() { env PYTHONPATH="$PWD" "$PY" "$@"; }
before() { env PYTHONPATH="$BEFORE" "$PY" "$@"; }
G=(tests/benchmarks/bench_gather.py --work "$WORK/gather" --keep)
T=(tests/benchmarks/bench_tokens.py --work "$WORK/tokens" --keep)
for i in 1 2; do
  run "gather after $i" after "${G[@]}"; run "gather before $i" before "${G[@]}"
done
run "gather cold after" after "${G[@]}" --cold; run "gather cold before" before "${G[@]}" --cold
run "gather 2 ranks after" after "${G[@]}" --ranks 2
run "gather 2 ranks before" before "${G[@]}" --ranks 2
for i in 1 2; do
  run "tokens after $i" after "${T[@]}"; run "tokens before $i" before "${T[@]}"
done
L=(tests/benchmarks/bench_loading.py --rows 20000 --work "$WORK/loading" --keep)
run "loading after" after "${L[@]}"; run "loading before" before "${L[@]}"
V=(tests/benchmarks/bench_varlen.py --readers limit,precache --rounds 1)
run "varlen after" after "${V[@]}"; run "varlen before" before "${V[@]}"
R=(tests/benchmarks/bench_varlen.py --workload tokens --readers limit,precache --ranks 2)
run "varlen 2 ranks after" after "${R[@]}"; run "varlen 2 ranks before" before "${R[@]}"
echo "=== done $(date +%T); delete $WORK when finished"
