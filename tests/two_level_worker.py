"""One rank of a world spread over pretend hosts (network namespaces), for
``test_two_level.py``: ``two_level_worker.py MODE LOOP RANK ADDR PORT N``.

Modes (no aiodist variable in the environment; ``LOOP`` is ``asyncio`` or ``uvloop``):
    cases   every collective of :data:`two_level_cases.CASES` on the world and on a group
            of ranks 0-2, then one line of JSON: each case's result (see ``result_of``) and
            how the groups run their collectives
    kill    a large all_reduce during which rank N-1 kills itself; the others print the
            error they got
    sync    as ``cases``, through the blocking facade (``aiodist.sync``; ``LOOP`` unused)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import numpy as np
from two_level_cases import CASES, call, finish_now, run_case

import aiodist
import aiodist.sync

mode, loop, rank, addr, port, n = sys.argv[1:7]
rank_, world_size = int(rank), int(n)


async def main() -> dict[str, object]:
    await aiodist.init_process_group(
        init_method=f"tcp://{addr}:{port}", rank=rank_, world_size=world_size, timeout=30
    )
    if mode == "kill":
        x = np.ones(8 << 20)
        if rank_ == world_size - 1:
            asyncio.get_running_loop().call_later(0.02, os.kill, os.getpid(), signal.SIGKILL)
        try:
            while True:
                await aiodist.all_reduce(x)
        except aiodist.DistError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
    return await run_cases(aiodist, await aiodist.new_group([0, 1, 2]))


async def run_cases(api: Any, group: Any) -> dict[str, object]:
    # Every case on the world, and on the group of ranks 0-2, through api (aiodist or
    # aiodist.sync).
    results: dict[str, object] = {}
    for case in CASES:
        results[case] = await run_case(case, rank_, world_size, None, api)
        if group is not aiodist.NON_GROUP_MEMBER:
            results[f"{case} in 0-2"] = await run_case(case, rank_, 3, group, api)
    paths = {"world": repr(aiodist.group.current_world().default_group.paths.get("cpu"))}
    if group is not aiodist.NON_GROUP_MEMBER:
        paths["0-2"] = repr(group.paths.get("cpu"))
    await call(api, "destroy_process_group")
    return {"results": results, "paths": paths}


def main_blocking() -> dict[str, object]:
    aiodist.sync.init_process_group(
        init_method=f"tcp://{addr}:{port}", rank=rank_, world_size=world_size, timeout=30
    )
    return finish_now(run_cases(aiodist.sync, aiodist.sync.new_group([0, 1, 2])))


if mode == "sync":
    print(json.dumps({"rank": rank_, **main_blocking()}), flush=True)
    sys.exit()
if loop == "uvloop":
    import uvloop

    factory = uvloop.new_event_loop
else:
    factory = asyncio.new_event_loop
with asyncio.Runner(loop_factory=factory) as runner:
    print(json.dumps({"rank": rank_, **runner.run(main())}), flush=True)
