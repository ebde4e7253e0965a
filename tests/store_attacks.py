"""A store server in a process of its own, and clients that attack it, for the security tests.

``python store_attacks.py LOOP NOFILE TOKEN`` starts a :class:`TCPStoreServer` with ``TOKEN``
on ``LOOP`` (``uvloop`` or ``asyncio``) in a process limited to ``NOFILE`` open files (0: no
limit), prints its port and serves until its standard input closes. :class:`ServerProcess`
runs it and reads what the attacks cost it: memory, CPU time and log lines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from aiodist._util._loop import loop_factory
from aiodist.store._server import TCPStoreServer
from aiodist.store._wire import I64, U8, U32, U64, TorchOp

#: What torch's client sends first: VALIDATE with its magic number.
VALIDATE = U8.pack(TorchOp.VALIDATE) + U32.pack(0x3C85F7CE)


def torch_set_head(key: bytes, value_size: int) -> bytes:
    """The start of a torch-wire SET announcing a value of ``value_size`` bytes."""
    return U8.pack(TorchOp.SET) + U64.pack(len(key)) + key + U64.pack(value_size)


def torch_add(key: bytes, amount: int) -> bytes:
    """A whole torch-wire ADD request."""
    return U8.pack(TorchOp.ADD) + U64.pack(len(key)) + key + I64.pack(amount)


def _proc_status(pid: int) -> dict[str, int]:
    """The ``kB`` fields of ``/proc/<pid>/status``, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[name] = int(value.split()[0]) * 1024
    return out


def cpu_seconds(pid: int) -> float:
    """The user and system CPU time process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """A store server in a subprocess (see the module docstring); a context manager."""

    def __init__(self, loop: str, token: str, nofile: int = 0) -> None:
        self._start([sys.executable, __file__, loop, str(nofile), token])

    def _start(self, command: list[str]) -> None:
        """Run ``command``, which prints the port it listens on first."""
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{command} did not start: {self.proc.communicate()[1]!r}")
        self.port = int(line)
        self.stderr = b""

    def memory(self) -> dict[str, int]:
        """The server's ``VmRSS`` and ``VmHWM`` (its peak), in bytes."""
        return _proc_status(self.proc.pid)

    def cpu(self) -> float:
        """Its CPU time so far, in seconds."""
        return cpu_seconds(self.proc.pid)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.proc.kill()
        _, self.stderr = self.proc.communicate(timeout=30)


def idle_sockets(port: int, count: int, sources: list[str]) -> list[socket.socket]:
    """``count`` connections to the server that never send a byte, from ``sources`` in turn."""
    socks = []
    for i in range(count):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closed ``sock`` within ``seconds`` (what it sent is skipped)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


async def _serve(token: str) -> None:
    server = await TCPStoreServer(auth_token=token).start("127.0.0.1", 0)
    print(server.port, flush=True)
    # Until the test closes our standard input (or kills us).
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    await server.aclose()


def _main() -> None:
    loop_kind, nofile, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    with asyncio.Runner(loop_factory=loop_factory(loop_kind)) as runner:
        runner.run(_serve(token))


if __name__ == "__main__":
    _main()
