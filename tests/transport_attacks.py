"""A transport rank in a process of its own, for the security tests.

``python transport_attacks.py LOOP NOFILE TOKEN STORE`` makes rank 0 of 2 of a
:class:`TCPTransport` with ``TOKEN`` on ``LOOP`` (``uvloop`` or ``asyncio``) in a process
limited to ``NOFILE`` open files (0: no limit), whose ranks meet in the FileStore ``STORE``.
It prints its port, then the sender and the bytes (hex) of the first message tagged
:data:`TAG` from any rank, and runs until its standard input closes. :class:`RankProcess`
runs it; what the attacks cost it is read as for the store (``store_attacks``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys

from store_attacks import ServerProcess

from aiodist._util._loop import loop_factory
from aiodist.store import FileStore
from aiodist.transport.base import PeerDirectory
from aiodist.transport.tcp import TCPTransport

#: The tag and the bytes of the message rank 1 sends.
TAG = (7, 1, 0)
MESSAGE = b"from the real rank 1"


class RankProcess(ServerProcess):
    """Rank 0 in a subprocess (see the module docstring); a context manager."""

    def __init__(self, loop: str, token: str, store: str, nofile: int = 0) -> None:
        self._start([sys.executable, __file__, loop, str(nofile), token, store])

    def message(self) -> str:
        """The ``sender hex`` line rank 0 printed for the message it received."""
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode().strip()


async def _rank(token: str, store_path: str) -> None:
    store = FileStore(store_path, timeout=60)
    transport = await TCPTransport.create(PeerDirectory(store), 0, 2, timeout=60, auth_token=token)
    print(transport.address[1], flush=True)
    got = bytearray(len(MESSAGE))
    # From any rank: a receive from rank 1 would connect to it, which the attacks do not
    # need to wait for.
    sender = await transport.recv_into(None, TAG, memoryview(got))
    print(sender, got.hex(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    await transport.aclose()


def _main() -> None:
    loop_kind, nofile, token, store = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    with asyncio.Runner(loop_factory=loop_factory(loop_kind)) as runner:
        runner.run(_rank(token, store))


if __name__ == "__main__":
    _main()
