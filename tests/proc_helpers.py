"""Launcher processes a test started, killed after it if it left them running.

A test that fails while its processes run (a ``communicate(timeout=...)`` that expired)
would otherwise leave them to the tests after it, where they surface as unrelated
``ResourceWarning`` failures.
"""

from __future__ import annotations

import subprocess
import sys

_started: list[subprocess.Popen[str]] = []


def track(proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """Remember ``proc``, so that :func:`reap` kills it if the test leaves it running."""
    _started.append(proc)
    return proc


def reap() -> None:
    """Kill what is still running of the tracked processes, printing their output; wait for all."""
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            out, err = proc.communicate()
            print(f"killed {proc.args}:\n{out}\n{err}", file=sys.stderr)
        else:
            proc.communicate()
