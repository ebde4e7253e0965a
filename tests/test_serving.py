"""aiodist.serving with the ranks as tasks of one loop: the channel's calls, replies, failures
and deadlines, and the controller's life cycle (start, rebuild, shutdown).

The same code in real processes behind real HTTP servers: tests/test_serving_http.py and
tests/test_serving_faults.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from serving_helpers import joins

import aiodist
from aiodist import serving
from aiodist.serving import Channel, Controller, RemoteError, Unavailable, _wire as wire
from aiodist.testing import run_world

pytestmark = pytest.mark.both_loops


# -- handlers -------------------------------------------------------------------------------------
def _split(w: np.ndarray, group: aiodist.ProcessGroup) -> np.ndarray:
    return np.split(w, group.size, axis=1)[group.rank]


W1 = np.random.default_rng(1).standard_normal((6, 8))
W2 = np.random.default_rng(2).standard_normal((8, 4))


async def mlp(x: np.ndarray) -> np.ndarray:
    """Both layers split by columns, the hidden layer all-gathered: the examples' model."""
    group = serving.worker_group()
    h = np.maximum(x @ _split(W1, group), 0)
    hidden = np.empty((group.size, *h.shape), h.dtype)
    await aiodist.all_gather_into_tensor(hidden, h, group=group)
    return np.concatenate(hidden, axis=1) @ _split(W2, group)


async def echo(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    return arrays


async def nothing(*arrays: np.ndarray) -> None:
    return None


async def total(x: np.ndarray) -> np.float64:
    return np.float64(x.sum() * (serving.worker_group().rank + 1))


async def gather_ranks() -> np.ndarray:
    group = serving.worker_group()
    out = np.empty(group.size, np.int64)
    await aiodist.all_gather_into_tensor(out, np.array([group.rank]), group=group)
    return out


async def fail_before(x: np.ndarray) -> np.ndarray:
    """Group rank 0 raises before the all_gather its peers enter."""
    group = serving.worker_group()
    if group.rank == 0:
        raise ValueError(f"bad shard for {x.shape}")
    out = np.empty((group.size, *x.shape), x.dtype)
    await aiodist.all_gather_into_tensor(out, x, group=group)
    return out


async def fail_after(x: np.ndarray) -> np.ndarray:
    """Every worker finishes the all_gather; then the last one raises."""
    group = serving.worker_group()
    out = np.empty((group.size, *x.shape), x.dtype)
    await aiodist.all_gather_into_tensor(out, x, group=group)
    if group.rank == group.size - 1:
        raise KeyError("late")
    return out


async def fail_between(x: np.ndarray) -> np.ndarray:
    """Two collectives; the last worker raises between them."""
    group = serving.worker_group()
    await aiodist.all_reduce(x, group=group)
    if group.rank == group.size - 1:
        raise RuntimeError("between")
    await aiodist.all_reduce(x, group=group)
    return x


async def fail_alone() -> None:
    """No collectives; only the first worker raises."""
    if serving.worker_group().rank == 0:
        raise ZeroDivisionError("alone")


async def bad_reply() -> list[int]:
    return [1, 2]


async def deep_reply() -> np.ndarray:
    return np.zeros((1,) * 33)


async def slow(seconds: np.ndarray) -> np.ndarray:
    """The last worker sleeps, the others answer at once."""
    group = serving.worker_group()
    if group.rank == group.size - 1:
        await asyncio.sleep(float(seconds[0]))
    return seconds


HANDLERS: dict[str, Callable[..., Awaitable[Any]]] = {
    "mlp": mlp,
    "echo": echo,
    "nothing": nothing,
    "total": total,
    "gather_ranks": gather_ranks,
    "fail_before": fail_before,
    "fail_after": fail_after,
    "fail_between": fail_between,
    "fail_alone": fail_alone,
    "bad_reply": bad_reply,
    "deep_reply": deep_reply,
    "slow": slow,
}


def reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ W1, 0) @ W2


async def serve_or_call(
    rank: int, size: int, controller: Callable[[Channel], Awaitable[Any]]
) -> Any:
    """Rank 0 runs ``controller(channel)`` then closes; the others serve until closed."""
    channel = await Channel.create()
    if rank == 0:
        try:
            return await controller(channel)
        finally:
            await channel.aclose()
    await channel.serve(HANDLERS)
    assert channel.closed
    return None


# -- calls and replies ----------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 5])
async def test_a_tensor_parallel_call_equals_numpy(size: int) -> None:
    x = np.random.default_rng(3).standard_normal((5, 6))

    async def controller(channel: Channel) -> list[Any]:
        return await channel.call("mlp", x, timeout=10)

    replies = (await run_world(lambda r, n: serve_or_call(r, n, controller), size))[0]
    assert len(replies) == size - 1
    np.testing.assert_allclose(np.concatenate(replies, axis=1), reference(x), rtol=1e-12)


async def test_replies_are_what_each_handler_returned() -> None:
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    b = np.array([True, False])
    c = np.empty((0, 3), np.complex64)
    f = np.asfortranarray(np.arange(6.0).reshape(2, 3))

    async def controller(channel: Channel) -> dict[str, list[Any]]:
        return {
            "echo": await channel.call("echo", a, b, c, f),
            "none": await channel.call("nothing", a),
            "scalar": await channel.call("total", a),
            "empty": await channel.call("echo"),
            "ranks": await channel.call("gather_ranks"),
        }

    got = (await run_world(lambda r, n: serve_or_call(r, n, controller), 3))[0]
    for reply in got["echo"]:
        assert isinstance(reply, tuple) and len(reply) == 4
        for sent, back in zip((a, b, c, f), reply, strict=True):
            assert back.dtype == sent.dtype and back.shape == sent.shape
            np.testing.assert_array_equal(back, sent)
    assert got["none"] == [None, None]
    assert [r.shape for r in got["scalar"]] == [(), ()]
    assert [float(r) for r in got["scalar"]] == [66.0, 132.0]
    assert got["empty"] == [(), ()]
    assert [r.tolist() for r in got["ranks"]] == [[0, 1], [0, 1]]


async def test_headers_longer_than_one_message_and_large_arrays() -> None:
    # 250 arrays of eight dimensions make headers (the call's and the replies') of about
    # 7 KiB, which go on in a second message; the arrays then travel on their own.
    arrays = [np.full((1, 1, 1, 1, 1, 1, 1, i % 7 + 1), i, np.float32) for i in range(250)]
    big = np.random.default_rng(4).standard_normal(1 << 18)  # 2 MiB
    name = "echo"

    async def controller(channel: Channel) -> tuple[list[Any], list[Any]]:
        return await channel.call(name, *arrays), await channel.call(name, big)

    many, large = (await run_world(lambda r, n: serve_or_call(r, n, controller), 3))[0]
    for reply in many:
        assert len(reply) == 250
        for sent, back in zip(arrays, reply, strict=True):
            np.testing.assert_array_equal(back, sent)
    for (back,) in large:
        np.testing.assert_array_equal(back, big)


@pytest.mark.parametrize("over", [-1, 0, 1])
def test_arrays_travel_inside_the_header_exactly_when_they_fit(over: int) -> None:
    message = {"op": "call", "arrays": [["|u1", [0]]]}
    room = wire.ROOM - len(json.dumps(message, separators=(",", ":")))
    a = np.arange(room + over, dtype=np.uint8)
    message["arrays"] = [["|u1", [len(a)]]]
    room = wire.ROOM - len(json.dumps(message, separators=(",", ":")))
    parts, inside = wire.encode(message, [a])
    assert inside == (len(a) <= room)
    assert parts[0].shape == (wire.FIRST,)
    assert wire.overflow(parts[0]) == 0
    decoded, carried = wire.decode(parts[0], None)
    assert decoded == message
    if inside:
        assert len(parts) == 1 and carried is not None
        (back,) = wire.unpack(carried, decoded["arrays"])
    else:
        assert carried is None and len(parts) == 2
        back = parts[1]
    np.testing.assert_array_equal(back, a)


async def test_concurrent_calls_from_many_tasks_do_not_interleave() -> None:
    xs = [np.random.default_rng(i).standard_normal((i % 3 + 1, 6)) for i in range(32)]

    async def controller(channel: Channel) -> list[list[Any]]:
        async def one(x: np.ndarray) -> list[Any]:
            await asyncio.sleep(0.001 * (len(x)))  # let the tasks overtake each other
            return await channel.call("mlp", x, timeout=20)

        return list(await asyncio.gather(*(one(x) for x in xs)))

    results = (await run_world(lambda r, n: serve_or_call(r, n, controller), 3))[0]
    for x, replies in zip(xs, results, strict=True):
        np.testing.assert_allclose(np.concatenate(replies, axis=1), reference(x), rtol=1e-12)


# -- failures that fail one call ----------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 4])
async def test_a_handler_that_raises_fails_its_call_only(size: int) -> None:
    x = np.ones((2, 6))

    async def controller(channel: Channel) -> list[tuple[str, object]]:
        outcomes: list[tuple[str, object]] = []
        for name in ("fail_before", "fail_after", "fail_between", "fail_alone", "nope"):
            started = time.monotonic()
            args = () if name in ("fail_alone", "nope") else (x.copy(),)
            with pytest.raises(RemoteError) as info:
                await channel.call(name, *args, timeout=10)
            assert time.monotonic() - started < 5.0  # nobody waited out the 10 s deadline
            outcomes.append((name, info.value))
            # The group is usable and the workers are in step again.
            if 8 % (size - 1) == 0:
                replies = await channel.call("mlp", x, timeout=10)
                np.testing.assert_allclose(np.concatenate(replies, axis=1), reference(x))
            ranks = await channel.call("gather_ranks", timeout=10)
            assert [r.tolist() for r in ranks] == [list(range(size - 1))] * (size - 1)
        return outcomes

    outcomes = dict((await run_world(lambda r, n: serve_or_call(r, n, controller), size))[0])
    last = size - 1
    before = outcomes["fail_before"]
    assert isinstance(before, RemoteError) and before.name == "fail_before"
    assert before.failures[1] == "ValueError: bad shard for (2, 6)"
    # The peers that waited for rank 1 in the all_gather were told why, at once.
    for r in range(2, size):
        assert "was rejected by rank 1" in before.failures[r], before.failures
        assert "ValueError: bad shard" in before.failures[r]
    assert str(before).startswith("call 'fail_before' failed on rank 1: ValueError: bad shard")
    assert outcomes["fail_after"].failures == {last: "KeyError: 'late'"}  # type: ignore[attr-defined]
    between = outcomes["fail_between"].failures  # type: ignore[attr-defined]
    assert between[last] == "RuntimeError: between"
    assert all("was rejected by rank" in between[r] for r in between if r != last), between
    assert outcomes["fail_alone"].failures == {1: "ZeroDivisionError: alone"}  # type: ignore[attr-defined]
    nope = outcomes["nope"].failures  # type: ignore[attr-defined]
    assert sorted(nope) == list(range(1, size))
    assert nope[1].startswith("LookupError: no handler named 'nope' (this worker serves [")


async def test_a_reply_that_is_not_arrays_fails_the_call() -> None:
    async def controller(channel: Channel) -> list[str]:
        texts = []
        for name in ("bad_reply", "deep_reply"):
            with pytest.raises(RemoteError) as info:
                await channel.call(name)
            texts.append(str(info.value))
            assert (await channel.call("echo", np.ones(2)))[0][0].tolist() == [1.0, 1.0]
        return texts

    texts = (await run_world(lambda r, n: serve_or_call(r, n, controller), 2))[0]
    assert texts == [
        "call 'bad_reply' failed on rank 1: DistUsageError: handler 'bad_reply' returned "
        "list; a handler returns an array, a tuple of arrays, or None",
        "call 'deep_reply' failed on rank 1: DistUsageError: handler 'deep_reply' returned: "
        "an array of 33 dimensions (at most 32)",
    ]


async def test_usage_errors_reject_the_call_and_send_nothing() -> None:
    async def controller(channel: Channel) -> list[str]:
        errors = []
        cases: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
            ("", (), {}),
            (7, (), {}),
            ("echo", ([1.0, 2.0],), {}),
            ("echo", (np.array(["a"]),), {}),
            ("echo", (np.ones(2), np.array([object()])), {}),
            ("echo", (np.zeros((1,) * 33),), {}),
            ("echo", (), {"timeout": -1}),
            ("echo", (), {"timeout": "soon"}),
        ]
        for name, args, kwargs in cases:
            with pytest.raises(aiodist.DistUsageError) as info:
                await channel.call(name, *args, **kwargs)
            errors.append(str(info.value))
        with pytest.raises(aiodist.DistUsageError, match=r"^serve: rank 0 is the controller"):
            await channel.serve(HANDLERS)
        with pytest.raises(aiodist.DistUsageError, match=r"only available inside a handler"):
            serving.worker_group()
        # None of them reached the workers: the next call is the first they see.
        assert channel.calls == 0
        assert [r.tolist() for r in await channel.call("gather_ranks")] == [[0, 1], [0, 1]]
        return errors

    async def fn(rank: int, size: int) -> Any:
        if rank == 0:
            return await serve_or_call(rank, size, controller)
        channel = await Channel.create()
        for bad in ({}, [("echo", echo)], {"": echo}, {"echo": 3}):
            with pytest.raises(aiodist.DistUsageError, match=r"^serve: "):
                await channel.serve(bad)  # type: ignore[arg-type]
        with pytest.raises(aiodist.DistUsageError, match=r"^call: only the controller"):
            await channel.call("echo")
        with pytest.raises(aiodist.DistUsageError, match=r"^close: only the controller"):
            await channel.aclose()
        await channel.serve(HANDLERS)
        return None

    errors = (await run_world(fn, 3))[0]
    assert errors[0].startswith("call: a handler name must be a non-empty string")
    assert errors[1].startswith("call: a handler name must be a non-empty string")
    assert errors[2] == (
        "call 'echo': argument 0 must be a numpy array or a CPU tensor supporting DLPack, got list"
    )
    assert errors[3].startswith("call 'echo': argument 0 has unsupported dtype <U1")
    assert errors[4].startswith("call 'echo': argument 1 has unsupported dtype object")
    assert errors[5] == "call 'echo': an array of 33 dimensions (at most 32)"
    assert errors[6] == "call 'echo': timeout must not be negative, got -1.0 s"
    assert errors[7] == "call 'echo': timeout must be seconds or a datetime.timedelta, got str"


async def test_calls_after_close_raise_and_close_waits_for_calls_in_flight() -> None:
    async def fn(rank: int, size: int) -> Any:
        channel = await Channel.create()
        if rank != 0:
            await channel.serve(HANDLERS)
            return channel.closed
        pending = asyncio.ensure_future(channel.call("slow", np.array([0.3])))
        await asyncio.sleep(0.05)
        await channel.aclose()
        assert pending.done()  # close took its turn after the call in flight
        with pytest.raises(aiodist.DistUsageError, match=r"^call: the channel is closed"):
            await channel.call("echo")
        await channel.aclose()  # twice is fine
        return [r.tolist() for r in pending.result()]

    assert await run_world(fn, 3) == [[[0.3], [0.3]], True, True]


async def test_a_caller_that_stops_waiting_leaves_the_channel_in_step() -> None:
    async def controller(channel: Channel) -> list[Any]:
        waiter = asyncio.ensure_future(channel.call("slow", np.array([0.3])))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # The next call runs once the workers have answered the abandoned one.
        return await channel.call("mlp", np.ones((1, 6)), timeout=10)

    replies = (await run_world(lambda r, n: serve_or_call(r, n, controller), 3))[0]
    np.testing.assert_allclose(np.concatenate(replies, axis=1), reference(np.ones((1, 6))))


# -- deadlines ---------------------------------------------------------------------------------------
async def test_waiting_for_earlier_calls_past_the_deadline_sends_nothing() -> None:
    async def controller(channel: Channel) -> str:
        first = asyncio.ensure_future(channel.call("slow", np.array([0.5])))
        await asyncio.sleep(0.05)
        with pytest.raises(aiodist.DistTimeoutError) as info:
            await channel.call("echo", np.ones(1), timeout=0.1)
        await first
        assert not channel.group.is_aborted()
        assert [r.tolist() for r in await channel.call("gather_ranks")] == [[0, 1], [0, 1]]
        return str(info.value)

    text = (await run_world(lambda r, n: serve_or_call(r, n, controller), 3))[0]
    assert text == (
        "call 'echo': the earlier calls did not finish within the call's timeout of 0.1 s; "
        "nothing was sent"
    )


async def test_a_worker_past_the_deadline_fails_the_call_and_aborts_the_world() -> None:
    async def fn(rank: int, size: int) -> Any:
        channel = await Channel.create()
        if rank != 0:
            with pytest.raises(aiodist.DistError) as info:
                await channel.serve(HANDLERS)
            return type(info.value).__name__
        started = time.monotonic()
        with pytest.raises(aiodist.DistTimeoutError) as caught:
            await channel.call("slow", np.array([3.0]), timeout=0.5)  # the worker sleeps 3 s
        took = time.monotonic() - started
        assert channel.group.is_aborted()
        cause = await channel.group.wait_aborted()
        return took, str(caught.value), str(cause)

    (took, text, cause), *workers = await run_world(fn, 3)
    assert 0.5 <= took < 3.0, took  # the deadline ended it, not the worker's 3 s sleep
    assert text == (
        "call 'slow' did not complete within the call's timeout of 0.5 s: no reply from "
        "ranks [2]; the process group is aborted"
    )
    assert "still waiting for messages from ranks [2]" in cause, cause
    assert all(issubclass(getattr(aiodist, w), aiodist.DistError) for w in workers), workers


# -- the life cycle --------------------------------------------------------------------------------
def isolated() -> contextvars.Context:
    """A context whose default world is its own (one rank of an in-process job)."""
    context = contextvars.copy_context()
    context.run(aiodist.group.isolate_context)
    return context


async def start_in(context: contextvars.Context, controller: Controller) -> None:
    async def start() -> None:
        controller.start()

    await asyncio.create_task(start(), context=context)


def start_workers(store: aiodist.Store, size: int, **kw: Any) -> list[asyncio.Task[None]]:
    return [
        asyncio.create_task(
            serving.run_worker(HANDLERS, store=store, rank=r, world_size=size, **kw),
            context=isolated(),
        )
        for r in range(1, size)
    ]


async def test_the_controller_answers_unavailable_until_every_rank_joined() -> None:
    store = aiodist.HashStore()
    controller = Controller(store=store, rank=0, world_size=3, timeout=30)
    with pytest.raises(Unavailable, match=r"^not ready \(new\): not started$"):
        await controller.call("mlp", np.ones((1, 6)))
    await start_in(isolated(), controller)
    await asyncio.sleep(0.2)
    assert controller.state == "starting"
    with pytest.raises(Unavailable) as info:
        await controller.call("mlp", np.ones((1, 6)))
    assert (info.value.state, info.value.reason) == (
        "starting",
        "waiting for every rank to join the process group",
    )
    assert controller.health() == {
        "ready": False,
        "state": "starting",
        "reason": "waiting for every rank to join the process group",
        "generation": 0,
        "world_size": 3,
        "calls": 0,
        "failed": 0,
        "in_flight": 0,
        "refused": 2,  # (before it started, and now)
    }
    workers = start_workers(store, 3)
    await controller.wait_ready(10)
    replies = await controller.call("mlp", np.ones((2, 6)), timeout=10)
    np.testing.assert_allclose(np.concatenate(replies, axis=1), reference(np.ones((2, 6))))
    assert controller.health()["ready"] and controller.health()["calls"] == 1
    await controller.aclose()
    assert controller.state == "closed"
    await asyncio.wait_for(asyncio.gather(*workers), 10)  # every worker's serve returned
    with pytest.raises(Unavailable, match=r"^not ready \(closed\): shut down$"):
        await controller.call("mlp", np.ones((1, 6)))


async def test_the_controller_rebuilds_the_group_after_a_failure() -> None:
    store = aiodist.HashStore()
    controller = Controller(store=store, rank=0, world_size=3, timeout=30)
    await start_in(isolated(), controller)
    workers = start_workers(store, 3)
    first = await controller.wait_ready(10)
    await controller.call("gather_ranks", timeout=10)
    first.group.abort("a worker was lost")
    with pytest.raises(aiodist.DistError, match="a worker was lost"):
        await controller.call("gather_ranks", timeout=10)  # the abort is seen at once
    await asyncio.sleep(0)
    assert controller.state == "rebuilding"
    assert "a worker was lost" in controller.health()["reason"]
    second = await controller.wait_ready(10)
    assert second is not first and controller.health()["generation"] == 2
    replies = await controller.call("mlp", np.ones((1, 6)), timeout=10)
    np.testing.assert_allclose(np.concatenate(replies, axis=1), reference(np.ones((1, 6))))
    await controller.aclose()
    await asyncio.wait_for(asyncio.gather(*workers), 10)


async def test_without_rebuild_the_controller_stays_failed_and_workers_raise() -> None:
    store = aiodist.HashStore()
    controller = Controller(store=store, rank=0, world_size=2, timeout=30, rebuild=False)
    await start_in(isolated(), controller)
    (worker,) = start_workers(store, 2, rebuild=False)
    channel = await controller.wait_ready(10)
    channel.group.abort("stop here")
    with pytest.raises(aiodist.DistError, match="stop here"):
        await worker
    while controller.state != "failed":
        await asyncio.sleep(0.01)
    with pytest.raises(Unavailable, match=r"^not ready \(failed\): the process group failed: "):
        await controller.call("echo")
    await controller.aclose()


async def test_a_controller_on_another_rank_fails_with_the_reason() -> None:
    store = aiodist.HashStore()
    controller = Controller(store=store, rank=1, world_size=2, timeout=30)
    await start_in(isolated(), controller)
    with pytest.raises(Unavailable) as info:
        await controller.wait_ready(10)
    assert info.value.reason == (
        "cannot start the process group: the controller must be rank 0, but this process is "
        "rank 1; the other ranks run run_worker"
    )
    await controller.aclose()
    with pytest.raises(aiodist.DistUsageError, match=r"^rank 0 is the controller"):
        await asyncio.create_task(
            serving.run_worker(HANDLERS, store=store, rank=0, world_size=2), context=isolated()
        )


async def test_a_controller_closed_before_every_rank_joined_tells_the_workers() -> None:
    store = aiodist.HashStore()
    controller = Controller(store=store, rank=0, world_size=3, timeout=30)
    await start_in(isolated(), controller)
    worker = asyncio.create_task(  # rank 2 never comes
        serving.run_worker(HANDLERS, store=store, rank=1, world_size=3), context=isolated()
    )
    while await joins(store, 3) < 2:
        await asyncio.sleep(0.01)
    await controller.aclose()
    # Rank 1 hears that the world was aborted and joins the next one.
    async with asyncio.timeout(10):
        while await joins(store, 3) < 3:
            await asyncio.sleep(0.01)
    assert not worker.done()
    worker.cancel()
    with pytest.raises(asyncio.CancelledError):
        await worker
