"""Random programs of every operation checked against a numpy model (``program_fuzz``).

Each case runs one seed's program: 20-40 collectives, point-to-point calls and subgroup
calls on 2-4 ranks, with one-rank usage errors, cancelled awaits and an expiring
``work.wait(timeout)`` drawn in, over shared memory or TCP, through the async API (ranks as
tasks of one loop) or the blocking API (ranks as processes), on the standard loop or
uvloop. Every result must equal the model's, every rejection must reach the ranks it
concerns, and the group must stay usable after it. A failure prints the configuration, the
problems, the program and the command that replays it (``bench/fuzz.py``).

The staged cases run with a staging bound of 64 bytes, or 0 (no staging at all), on every
rank: most messages are then announced and their payloads wait for their receives (over
shared memory copied from the sender's memory), with receives posted late, works whose
waits are cancelled, and rejections that withdraw or refuse announced messages. The
credited cases keep the default bound over shared memory but offer every payload (the
eager limit 0): each is copied from its sender's memory at once, into its receive or into
a staging buffer.
"""

from __future__ import annotations

import itertools

import program_fuzz
import pytest
from program_fuzz import Config

from aiodist.transport import _shm_link

#: Every world size, transport and loop four times through the async API (seeds 1-48, a
#: few hundredths of a second each) and once through the blocking API (seeds 101-112, a
#: second or more each: the processes start).
_COMBOS = list(itertools.product((2, 3, 4), program_fuzz.TRANSPORTS, program_fuzz.LOOPS))
ASYNC_CASES = [
    Config(1 + i, ranks, transport, "async", loop)
    for i, (ranks, transport, loop) in enumerate(_COMBOS * 4)
]
SYNC_CASES = [
    Config(101 + i, ranks, transport, "sync", loop)
    for i, (ranks, transport, loop) in enumerate(_COMBOS)
]
#: Every world size, transport and loop with each small bound twice through the async API
#: (seeds 201-248), and each world size and transport once through the blocking API
#: (seeds 301-306: each loop on each transport, the bound 0 for 3 ranks, else 64).
STAGED_ASYNC_CASES = [
    Config(201 + i, ranks, transport, "async", loop, staging)
    for i, ((ranks, transport, loop), staging) in enumerate(itertools.product(_COMBOS * 2, (64, 0)))
]
#: Each world size and loop twice over shared memory, every payload credited (seeds 401-412).
CREDITED_CASES = [
    Config(401 + i, ranks, "shm", "async", loop)
    for i, (ranks, loop) in enumerate(itertools.product((2, 3, 4), program_fuzz.LOOPS * 2))
]
STAGED_SYNC_CASES = [
    Config(301, 2, "shm", "sync", "asyncio", 64),
    Config(302, 2, "tcp", "sync", "uvloop", 64),
    Config(303, 3, "shm", "sync", "uvloop", 0),
    Config(304, 3, "tcp", "sync", "asyncio", 0),
    Config(305, 4, "shm", "sync", "asyncio", 64),
    Config(306, 4, "tcp", "sync", "uvloop", 64),
]


def _check(config: Config) -> None:
    report = program_fuzz.run_program(config)
    assert not report.problems, report.describe()


@pytest.mark.parametrize("config", ASYNC_CASES, ids=lambda c: f"seed{c.name}")
def test_async_program(config: Config) -> None:
    _check(config)


@pytest.mark.multiprocess
@pytest.mark.slow  # (processes: a second or more a case; .ci/run runs them)
@pytest.mark.parametrize("config", SYNC_CASES, ids=lambda c: f"seed{c.name}")
def test_blocking_program_in_processes(config: Config) -> None:
    _check(config)


@pytest.mark.parametrize("config", STAGED_ASYNC_CASES, ids=lambda c: f"seed{c.name}")
def test_async_program_with_a_small_staging_bound(config: Config) -> None:
    _check(config)


@pytest.mark.multiprocess
@pytest.mark.slow  # (processes: a second or more a case; .ci/run runs them)
@pytest.mark.parametrize("config", STAGED_SYNC_CASES, ids=lambda c: f"seed{c.name}")
def test_blocking_program_in_processes_with_a_small_staging_bound(config: Config) -> None:
    _check(config)


@pytest.mark.parametrize("config", CREDITED_CASES, ids=lambda c: f"seed{c.name}")
def test_async_program_with_every_payload_credited(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_shm_link, "OFFERED_ABOVE", 0)
    _check(config)
