#!/usr/bin/env bash
# Set up a virtualenv, install aiodist with its test and documentation tools (and torch's CPU
# build, for the interoperability tests), run the linters, the type checker and the
# documentation build, then the whole test suite.
# Extra arguments go to pytest. The suite runs in a private network namespace with only
# loopback where the machine allows it, so nothing (torch's reverse DNS lookups included)
# leaves the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,docs]' 'torch==2.13.0'
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy aiodist
# The documentation site, every Sphinx warning an error (tests/test_docs.py reuses the build).
.venv/bin/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

# The whole suite takes a few minutes; the outer limit turns a hang that no per-test timeout
# could interrupt into a failure instead of a stalled run.
limit=(timeout --kill-after=30 1800)
if unshare -n true 2>/dev/null; then
  exec "${limit[@]}" unshare -n bash -c 'ip link set lo up && exec .venv/bin/pytest "$@"' pytest "$@"
fi
exec "${limit[@]}" .venv/bin/pytest "$@"
