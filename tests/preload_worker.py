"""A worker for the ``--preload`` tests: ``preload_worker.py MODE``.

Modes:
    report      print one JSON line: what a script can see of how it was started
    raise       raise ValueError("boom from rank N")
    sigkill     rank 1 kills itself with SIGKILL; the others exit 0
    crash-once  rank 1 exits 3 on its first start; every start prints the report
    ready       print "ready", then sleep
"""

import json
import os
import sys

# Read before this script imports anything: what the worker had loaded when it began.
PRELOADED = sorted(m for m in ("numpy", "aiodist", "aiodist.sync") if m in sys.modules)


def report() -> dict[str, object]:
    import numpy as np

    return {
        "preloaded": PRELOADED,
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "rank": int(os.environ["RANK"]),
        "restarts": int(os.environ["AIODIST_RESTART_COUNT"]),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "stdin": sys.stdin.read(),
        "random": int(np.random.randint(1 << 62)),
    }


def main() -> None:
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    if mode == "report":
        print(json.dumps(report()))
    elif mode == "raise":
        raise ValueError(f"boom from rank {rank}")
    elif mode == "sigkill" and rank == 1:
        os.kill(os.getpid(), 9)
    elif mode == "crash-once":
        print(json.dumps(report()), flush=True)
        if rank == 1 and os.environ["AIODIST_RESTART_COUNT"] == "0":
            sys.exit(3)
    elif mode == "ready":
        print("ready", flush=True)
        import time

        time.sleep(120)


if __name__ == "__main__":
    main()
