#!/usr/bin/env bash
# Set up a virtualenv, install aiodist with its test and documentation tools (and torch's CPU
# build, for the interoperability tests), run the linters, the type checker and the
# documentation build, then the test suite on python3 (3.11) but for its long jobs (markers
# slow and torch_suite, which .ci/run runs after this), and a fast subset of it on Python
# 3.12 and 3.13 where the machine has them (scripts/test-pythons.sh).
# Extra arguments go to the pytest of the suite. The tests run in a private network
# namespace with only loopback where the machine allows it, so nothing (torch's reverse DNS
# lookups included) leaves the machine. The exit status is non-zero if any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,docs]' 'torch==2.13.0'
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null
fi
# The cluster tests run the real launchers: SLURM (with munge), Open MPI's mpirun, MPICH's
# mpiexec (tests/test_slurm.py, tests/test_mpirun.py); the etcd store's tests a real etcd
# (tests/test_store_etcd.py).
missing=()
for tool in slurmctld:slurm-wlm slurmd:slurm-wlm srun:slurm-wlm munged:munge \
  mpirun.openmpi:openmpi-bin mpiexec.mpich:mpich etcd:etcd-server; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u)) >/dev/null
fi

# The static checks, the package and the documentation site are independent: they run side by
# side (each is one process), each one's output shown if it fails.
checks=$(mktemp -d)
check() {
  local name=$1
  shift
  ("$@") >"$checks/$name" 2>&1 || {
    echo "== $name failed:" >&2
    cat "$checks/$name" >&2
    return 1
  }
}
# The package as users get it: a wheel and an sdist that twine accepts, the sdist free of
# the virtualenv and of caches.
package() {
  local dist=$checks/dist
  .venv/bin/python -m build --outdir "$dist" . &&
    .venv/bin/twine check --strict "$dist"/*.whl "$dist"/*.tar.gz || return 1
  if tar tzf "$dist"/*.tar.gz | grep -E '/(\.venv[0-9]*|__pycache__|\.[a-z_]*cache|\.hypothesis|_build)/'; then
    echo "the sdist holds the files above, which it must not"
    return 1
  fi
}
pids=()
check ruff sh -c '.venv/bin/ruff check . && .venv/bin/ruff format --check .' & pids+=($!)
check mypy .venv/bin/mypy aiodist & pids+=($!)
check package package & pids+=($!)
# The documentation site, every Sphinx warning an error (tests/test_docs.py reuses the build).
check docs .venv/bin/python -m sphinx -n -W --keep-going -q -b html docs docs/_build/html &
pids+=($!)
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
rm -rf "$checks"
[ "$failed" = 0 ] || exit 1

# The suite takes a few minutes; the outer limit turns a hang that no per-test timeout
# could interrupt into a failure instead of a stalled run.
limit=(timeout --kill-after=30 1800)
status=0
if unshare -n true 2>/dev/null; then
  "${limit[@]}" unshare -n bash -c 'ip link set lo up && exec .venv/bin/pytest "$@"' pytest "$@" ||
    status=$?
else
  "${limit[@]}" .venv/bin/pytest "$@" || status=$?
fi
# The other supported versions: their own virtualenvs, the fast subset on each.
bash scripts/test-pythons.sh || status=$?
exit "$status"
