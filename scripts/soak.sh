#!/usr/bin/env bash
# Run a selection of tests many times in a row beside CPU-bound processes, as a fix is
# judged: `scripts/soak.sh RUNS [HOGS] -- PYTEST-ARGS...` (HOGS default 2). Each run is a
# fresh pytest in a private network namespace with only loopback; the first failing run
# stops the soak, its output kept. Prints one line per run and exits non-zero on a failure.
#
#   scripts/soak.sh 20 -- tests/test_leaving.py tests/test_forming.py
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:?usage: scripts/soak.sh RUNS [HOGS] -- PYTEST-ARGS...}
shift
hogs=2
if [ "${1:-}" != "--" ]; then
  hogs=${1:?usage: scripts/soak.sh RUNS [HOGS] -- PYTEST-ARGS...}
  shift
fi
[ "${1:-}" = "--" ] && shift

pids=()
for _ in $(seq "$hogs"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT

log=$(mktemp -t aiodist-soak.XXXXXX)
for run in $(seq "$runs"); do
  start=$SECONDS
  if unshare -n bash -c 'ip link set lo up && exec .venv/bin/pytest -q -p no:cacheprovider "$@"' \
    pytest "$@" >"$log" 2>&1; then
    echo "run $run of $runs: passed ($((SECONDS - start)) s; $(tail -n 1 "$log"))"
  else
    echo "run $run of $runs: FAILED ($((SECONDS - start)) s); its output: $log"
    tail -n 30 "$log"
    exit 1
  fi
done
rm -f "$log"
echo "$runs runs in a row passed beside $hogs CPU-bound processes"
