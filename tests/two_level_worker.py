"""One rank of a world spread over pretend hosts (network namespaces), for
``test_two_level.py``: ``two_level_worker.py MODE LOOP RANK ADDR PORT N``.

Modes (no aiodist variable in the environment; ``LOOP`` is ``asyncio`` or ``uvloop``):
    cases   every collective of :data:`two_level_cases.CASES` on the world and on a group
            of ranks 0-2, then one line of JSON: each case's result (see ``result_of``) and
            how the groups run their collectives
    kill    a large all_reduce during which rank N-1 kills itself; the others print the
            error they got
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import numpy as np
from two_level_cases import CASES, run_case

import aiodist

mode, loop, rank, addr, port, n = sys.argv[1:7]
rank_, world_size = int(rank), int(n)


async def main() -> dict[str, object]:
    await aiodist.init_process_group(
        init_method=f"tcp://{addr}:{port}", rank=rank_, world_size=world_size, timeout=30
    )
    world = aiodist.group.current_world()
    if mode == "kill":
        x = np.ones(8 << 20)
        if rank_ == world_size - 1:
            asyncio.get_running_loop().call_later(0.02, os.kill, os.getpid(), signal.SIGKILL)
        try:
            while True:
                await aiodist.all_reduce(x)
        except aiodist.DistError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
    group = await aiodist.new_group([0, 1, 2])
    results: dict[str, object] = {}
    for case in CASES:
        results[case] = await run_case(case, rank_, world_size, None)
        if group is not aiodist.NON_GROUP_MEMBER:
            results[f"{case} in 0-2"] = await run_case(case, rank_, 3, group)
    paths = {"world": repr(world.default_group.paths.get("cpu"))}
    if group is not aiodist.NON_GROUP_MEMBER:
        paths["0-2"] = repr(group.paths.get("cpu"))
    await aiodist.destroy_process_group()
    return {"results": results, "paths": paths}


if loop == "uvloop":
    import uvloop

    factory = uvloop.new_event_loop
else:
    factory = asyncio.new_event_loop
with asyncio.Runner(loop_factory=factory) as runner:
    print(json.dumps({"rank": rank_, **runner.run(main())}), flush=True)
