#!/usr/bin/env bash
# The main job: aiodist-run starts four worker processes on this machine, hosts their store
# on a free port, and supervises them while they train a linear model with data-parallel SGD
# (broadcast of the initial weights, an all_reduce of the gradients every step, all_gather
# of the losses). Every rank checks its weights against a single-process numpy run and says
# so.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import aiodist.launcher, numpy' 2>/dev/null || [ ! -x .venv/bin/aiodist-run ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e .
fi

exec .venv/bin/aiodist-run --standalone --nproc-per-node=4 examples/data_parallel_sgd.py
