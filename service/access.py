"""Who may call, how often, and whether there is room: API keys, client identity and the admission gate, all on
plain strings so that HTTP, gRPC and WebSocket transports share one implementation."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from service.errors import ForbiddenError, UnauthorizedError
from service.stores.ratelimit import RateLimiter

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Caller:
    """What a transport knows about a request: the API key it presented (None: none), where a key is
    expected (for the 401 message), the direct peer address and any X-Forwarded-For value."""

    key: str | None
    peer: str = "unknown"
    forwarded_for: str = ""
    key_hint: str = "an `Authorization: Bearer <key>` or `X-API-Key: <key>` header"


def presented_key(authorization: str, x_api_key: str = "") -> str | None:
    """The key a caller presented: an `Authorization: Bearer <key>` value, else an `X-API-Key` value; None for none."""
    scheme, _, token = authorization.partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else ""
    return key or x_api_key.strip() or None


class ApiKeys:
    """The configured keys (kept only as sha256 digests). Any key, user or admin, turns authentication on: every
    protected route then needs a key (admin keys alone still mean keys are on); no keys at all turns it off.

    Admin keys are accepted wherever a key is, and are the only keys `check_admin` accepts.
    """

    def __init__(self, keys: Sequence[str], admin_keys: Sequence[str] = ()) -> None:
        self._users = tuple(_digest(k) for k in keys)
        self._admins = tuple(_digest(k) for k in admin_keys)
        self._digests = self._users + self._admins

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def describe(self, public_lists: bool) -> str:
        """What is protected, for the start-up log (key counts only, never a key); `public_lists`: model and voice
        lists answer without a key (TTS_PUBLIC_MODEL_LIST)."""
        if not self.enabled:
            return ("API keys are off (TTS_API_KEYS and TTS_ADMIN_API_KEYS are empty): every route is open to anyone "
                    "who can reach this server, saving and deleting voices and lexicon writes included")  # fmt: skip
        counts = f"{len(self._users)} user and {len(self._admins)} admin keys"
        lists = "answer without a key (TTS_PUBLIC_MODEL_LIST)" if public_lists else "need a key too"
        return (f"API keys are on ({counts}): synthesis on every transport (HTTP, gRPC, WebSocket, DashScope), voice "
                "details and the lexicon need a key; saving and deleting voices and lexicon writes need an admin key; "
                f"an admin key works everywhere; model and voice lists {lists}")  # fmt: skip

    def check(self, caller: Caller, *, anonymous_ok: bool = False) -> None:
        """Raise UnauthorizedError unless the caller presented a configured key.

        `anonymous_ok`: a caller without any key passes (public listings); a key that is sent must still be valid.
        """
        if not self.enabled or (anonymous_ok and not caller.key):
            return
        if not _matches(self._presented(caller), self._digests):
            raise UnauthorizedError("the API key is not valid")

    def check_admin(self, caller: Caller) -> None:
        """Raise UnauthorizedError without a known key, ForbiddenError for a valid non-admin key (no-op with no keys)."""
        if not self._digests:
            return
        digest = self._presented(caller)
        if _matches(digest, self._admins):
            return
        if _matches(digest, self._users):
            raise ForbiddenError("this operation needs an admin API key (TTS_ADMIN_API_KEYS)")
        raise UnauthorizedError("the API key is not valid")

    def is_admin(self, caller: Caller) -> bool:
        """True when `check_admin` would let the caller through (no keys configured, or an admin key)."""
        return not self._digests or (caller.key is not None and _matches(_digest(caller.key), self._admins))

    @staticmethod
    def _presented(caller: Caller) -> bytes:
        if not caller.key:
            raise UnauthorizedError(f"an API key is required: send {caller.key_hint}")
        return _digest(caller.key)


class ClientIdentity:
    """Who a request counts against: its API key (hashed) when keys are on, else the client address.

    X-Forwarded-For is believed only when the direct peer is a configured trusted proxy; the client is
    then the right-most address in the header that is not itself a trusted proxy.
    """

    def __init__(self, trusted_proxies: Sequence[str], keys_enabled: bool) -> None:
        self.trusted: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(p, strict=False) for p in trusted_proxies)
        self.keys_enabled = keys_enabled

    def __call__(self, caller: Caller) -> str:
        if self.keys_enabled and caller.key:
            return "key:" + hashlib.sha256(caller.key.encode()).hexdigest()[:32]
        return "ip:" + self.client_ip(caller)

    def client_ip(self, caller: Caller) -> str:
        if not self._is_trusted(caller.peer):
            return caller.peer
        hops = [h.strip() for h in caller.forwarded_for.split(",") if h.strip()]
        for hop in reversed(hops):
            if not self._is_trusted(hop):
                return hop
        return hops[0] if hops else caller.peer

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted)


class Gate:
    """Admission of one synthesis request: API key (401), then the caller's rate limit (429 + Retry-After).

    Capacity (503) is the runtime's part (`Runtime.admit`), since it depends on the loaded service.
    """

    def __init__(self, keys: ApiKeys, identity: ClientIdentity, rate_limit: RateLimiter) -> None:
        self.keys = keys
        self.identity = identity
        self.rate_limit = rate_limit

    def check(self, caller: Caller) -> None:
        self.keys.check(caller)
        self.rate_limit.hit(self.identity(caller))


def _matches(digest: bytes, digests: tuple[bytes, ...]) -> bool:
    # compare against every key so the time taken does not reveal which one matched
    return any([hmac.compare_digest(digest, d) for d in digests])


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
