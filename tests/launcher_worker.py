"""A worker for the launcher tests: ``launcher_worker.py MODE [ARGS...]``.

Modes:
    env                 print the launcher's variables as one JSON line
    allreduce           init the group through env:// (async API), all_reduce rank+1, print
    sync-allreduce      the same with aiodist.sync, as a torch.distributed script would
    fail R CODE         rank R exits with CODE (the others wait to be stopped)
    finish-fail R CODE  the other ranks exit 0 at once; rank R exits with CODE after them
    errorfile R         rank R writes TORCHELASTIC_ERROR_FILE and exits 1
    crash-once R        group formed and all_reduce ran, then rank R exits 3 on attempt 0;
                        attempt 1 succeeds
    env-crash R         rank R exits 3 on its first start; every other start prints env's JSON
    rebuild R           for --restart-policy=failed: after a first all_reduce rank R exits 3;
                        the others' next all_reduce raises, they destroy and init the group
                        again and the replacement of rank R joins them; all_reduce of
                        rank + 1 + 10 * restart count in the rebuilt group
    early R WHEN        for --restart-policy=failed: rank R is SIGKILLed before its group
                        forms (WHEN: ``before`` init_process_group; ``during`` it, once
                        it counted in the world being formed; ``connected``, once connected
                        to every rank, before its leases); a restarted worker calls
                        join_process_group(state=[7, 7]), which takes its rank in the world
                        being formed; all_reduce of rank + 1 + 10 * restart count; print
                        the sum, the world size and the state
    graceful STEP HOW   print "ready", run steps of STEP seconds; on SIGTERM each rank does
                        what HOW (comma-separated, one per rank) says: finish (the current
                        step, then exit 0), finish143 (then exit 128 + SIGTERM) or ignore
    signals             print "ready", then report each of SIGINT/SIGTERM/SIGUSR1 and exit
    ignore-term         print "ready", ignore SIGTERM, sleep
    stdio               write a line to stdout and to stderr
    hang                print "ready" after the group formed, then all_reduce forever
    serve LINGER        like hang, but on SIGTERM each rank waits LINGER (comma-separated
                        seconds, one per rank), destroys its group and exits 0; an
                        all_reduce that fails before SIGTERM fails the worker
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time

import numpy as np

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
attempt = int(os.environ.get("AIODIST_RESTART_COUNT", "0"))
mode, args = sys.argv[1], sys.argv[2:]


async def allreduce() -> float:
    import aiodist

    await aiodist.init_process_group(backend="gloo", rank=rank, world_size=world)
    x = np.array([rank + 1.0])
    await aiodist.all_reduce(x)
    return float(x[0])


async def shutdown() -> None:
    import aiodist

    await aiodist.barrier()
    await aiodist.destroy_process_group()


def main() -> None:
    if mode == "env-crash" and attempt == 0 and rank == int(args[0]):
        raise SystemExit(3)
    if mode in ("env", "env-crash"):
        keys = sorted(k for k in os.environ if k.split("_")[0] in {"TORCHELASTIC", "AIODIST"})
        keys += [
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
        ]  # fmt: skip
        print(json.dumps({k: os.environ.get(k) for k in keys} | {"argv": args}))
    elif mode == "allreduce":

        async def run() -> None:
            total = await allreduce()
            print(f"sum={total:g} expected={world * (world + 1) / 2:g}")
            await shutdown()

        asyncio.run(run())
    elif mode == "sync-allreduce":
        import aiodist.sync as dist

        dist.init_process_group(backend="gloo", rank=rank, world_size=world)
        x = np.array([rank + 1.0])
        dist.all_reduce(x)
        dist.barrier()
        print(f"sum={x[0]:g} expected={world * (world + 1) / 2:g}")
        dist.destroy_process_group()
    elif mode == "fail":
        if rank == int(args[0]):
            time.sleep(0.2)
            print("failing on purpose", file=sys.stderr)
            raise SystemExit(int(args[1]))
        print("waiting", flush=True)
        time.sleep(60)
    elif mode == "finish-fail":
        if rank == int(args[0]):
            time.sleep(0.5)
            raise SystemExit(int(args[1]))
    elif mode == "errorfile":
        if rank == int(args[0]):
            try:
                raise KeyError("the root cause")
            except KeyError as exc:
                import traceback

                with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                    json.dump(
                        {
                            "message": {
                                "message": f"KeyError: {exc}",
                                "extraInfo": {
                                    "py_callstack": traceback.format_exc(),
                                    "timestamp": str(int(time.time())),
                                },
                            }
                        },
                        f,
                    )
            raise SystemExit(1)
        time.sleep(60)
    elif mode == "crash-once":

        async def run() -> None:
            total = await allreduce()
            if attempt == 0 and rank == int(args[0]):
                print(f"crashing after the group formed (sum={total:g})", file=sys.stderr)
                os._exit(3)
            await shutdown()
            print(f"attempt={attempt} sum={total:g}")

        asyncio.run(run())
    elif mode == "rebuild":

        async def run() -> None:
            import aiodist
            from aiodist.errors import DistError

            if attempt == 0:
                print(f"first sum={await allreduce():g} pid={os.getpid()}", flush=True)
                if rank == int(args[0]):
                    # Let the others finish reading this all_reduce before the connections close.
                    await asyncio.sleep(0.2)
                    print("crashing after the first all_reduce", file=sys.stderr, flush=True)
                    os._exit(3)
                try:
                    await aiodist.all_reduce(np.ones(1), timeout=60)
                except DistError as exc:
                    print(f"noticed {type(exc).__name__}: {exc}", flush=True)
                else:
                    raise SystemExit(f"an all_reduce without rank {args[0]} completed")
                await aiodist.destroy_process_group()
            await aiodist.init_process_group(backend="gloo", rank=rank, world_size=world)
            x = np.array([rank + 1.0 + 10 * attempt])
            await aiodist.all_reduce(x)
            print(f"rebuilt restart={attempt} sum={x[0]:g} pid={os.getpid()}", flush=True)
            await shutdown()

        asyncio.run(run())
    elif mode == "early":

        async def run() -> None:
            import aiodist

            if attempt == 0 and rank == int(args[0]):
                if args[1] == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                import aiodist._assembly._join as assembly
                import aiodist.group._world as world

                async def die(*_: object, **__: object) -> None:
                    os.kill(os.getpid(), signal.SIGKILL)

                if args[1] == "during":  # its generation counted, its lease not yet
                    assembly.connect_members = die
                else:  # "connected": to every rank, before its leases and set-up
                    world.FailureDomain.leased = die  # type: ignore[method-assign]
            state = np.zeros(2)
            if attempt == 0:
                await aiodist.init_process_group(backend="gloo", timeout=60)
            else:
                await aiodist.join_process_group(backend="gloo", timeout=60, state=[state])
            x = np.array([rank + 1.0 + 10 * attempt])
            await aiodist.all_reduce(x)
            print(
                f"restart={attempt} sum={x[0]:g} size={aiodist.get_world_size()} "
                f"state={state.tolist()}",
                flush=True,
            )
            await shutdown()

        asyncio.run(run())
    elif mode == "graceful":
        how = args[1].split(",")[rank]
        stopping: list[int] = []
        if how == "ignore":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, lambda s, _f: stopping.append(s))
        print("ready", flush=True)
        step = 0
        while not stopping:
            step += 1
            time.sleep(float(args[0]))  # a handled signal does not cut the step short
        code = 128 + signal.SIGTERM if how == "finish143" else 0
        print(f"SIGTERM x{len(stopping)} during step {step}: finished it, exit {code}", flush=True)
        raise SystemExit(code)
    elif mode == "signals":
        got = []
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, lambda s, _f: got.append(signal.Signals(s).name))
        print("ready", flush=True)
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        print(f"got {got[0]}", flush=True)
    elif mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    elif mode == "stdio":
        print(f"out line of rank {rank}")
        print(f"err line of rank {rank}", file=sys.stderr)
    elif mode == "hang":

        async def run() -> None:
            import aiodist

            await allreduce()
            print("ready", flush=True)
            x = np.ones(4)
            while True:
                await aiodist.all_reduce(x)
                await asyncio.sleep(0.05)

        asyncio.run(run())
    elif mode == "serve":

        async def run() -> None:
            import aiodist

            await allreduce()
            stop = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            print("ready", flush=True)

            async def steps() -> None:
                while True:
                    await aiodist.all_reduce(np.ones(4))
                    await asyncio.sleep(0.05)

            serving = asyncio.create_task(steps())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not stop.is_set():
                # The launcher signals its workers one after the other: a peer signalled first
                # may have left already, failing this rank's collective just before this
                # rank's own SIGTERM arrives.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 2)
            if not stop.is_set():
                serving.result()  # the collective's error, raised
            await asyncio.sleep(float(args[0].split(",")[rank]))
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiodist.DistError):
                await serving
            await aiodist.destroy_process_group()
            print("stopped after SIGTERM", flush=True)

        asyncio.run(run())
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
