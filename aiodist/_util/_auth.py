"""The shared secret that the TCPStore and the transport's peer connections both check.

One token (``auth_token=`` or ``$AIODIST_AUTH_TOKEN``) covers every connection of a job.
Each side proves that it holds the token with an HMAC-SHA256 over both sides' fresh nonces,
so a recorded exchange cannot be replayed, and over a role label, so one side's proof
cannot be reflected back as the other's answer. The token itself never crosses the wire.
Where a challenge cannot be had (an HTTP request to a status endpoint), a key derived from
the token for that one purpose is sent instead: it opens that and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from ..errors import DistUsageError

__all__ = [
    "AUTH_MAC_SIZE",
    "NONCE_SIZE",
    "auth_mac",
    "derive_key",
    "resolve_token",
    "verify_mac",
]

#: Bytes of a fresh random nonce and of an HMAC-SHA256 proof.
NONCE_SIZE = 32
AUTH_MAC_SIZE = 32


def resolve_token(auth_token: str | bytes | None) -> bytes | None:
    """Return the shared secret to use: ``auth_token``, else ``$AIODIST_AUTH_TOKEN``, else None.

    Raises:
        DistUsageError: the token is empty.
    """
    if auth_token is None:
        auth_token = os.environ.get("AIODIST_AUTH_TOKEN") or None
    if auth_token is None:
        return None
    token = auth_token.encode() if isinstance(auth_token, str) else bytes(auth_token)
    if not token:
        raise DistUsageError("auth_token must not be empty")
    return token


def auth_mac(token: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 proof that the sender holds ``token``, bound to both nonces and a role.

    The role (``b"store/client"``, ``b"peer/accept"``, ...) names the protocol and the side,
    which keeps one side's proof from being replayed as the other's answer or in the other
    protocol. ``second`` may carry more context after the nonce (the transport binds the
    ranks and the world size).
    """
    return hmac.new(token, b"aiodist/" + role + first + second, hashlib.sha256).digest()


def verify_mac(got: bytes, want: bytes) -> bool:
    """Compare two proofs in constant time."""
    return hmac.compare_digest(got, want)


def derive_key(token: bytes, purpose: str) -> str:
    """A key for ``purpose`` alone (``"status"``: the status endpoints), derived from the
    token: whoever learns it can use it there, but cannot work back to the token."""
    return hmac.new(token, b"aiodist/key/" + purpose.encode(), hashlib.sha256).hexdigest()
