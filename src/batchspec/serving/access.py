"""Who may call `batchspec serve`, and how big and how slow a request body may be, checked before
any work (the request's fields are checked in openai_api.py).

- Keys: `--api-key` (repeatable), `--api-key-file` (one per line; blank and `#` lines skipped) and
  the `BATCHSPEC_API_KEY` environment variable, all of them valid together (`read_keys`).
- `Guard`, an ASGI middleware (the same one in `serve` and in every Ray Serve replica): with keys,
  every path but /health (and /metrics, unless `metrics_auth`) needs `Authorization: Bearer <key>`,
  else 401 `invalid_api_key`; keys are compared in constant time over all of them and are never
  echoed. Then a POST body must be JSON (or untyped) else 415, declare and send at most
  `max_bytes` else 413 (counted while reading, chunked bodies included), and arrive within
  `body_timeout` seconds else 408. Every refusal closes the connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.errors import BatchspecError

ENV_KEY = "BATCHSPEC_API_KEY"
#: Largest request body, in bytes, unless --max-request-bytes says otherwise.
MAX_REQUEST_BYTES = 1 << 20
#: Seconds a client may take to send a request's body, unless --body-timeout says otherwise.
BODY_TIMEOUT_S = 30.0
#: Paths open without a key (/metrics too, unless metrics_auth).
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class Policy:
    """What `Guard` enforces. No keys: every path is open."""

    keys: tuple[str, ...] = ()
    metrics_auth: bool = False
    max_bytes: int = MAX_REQUEST_BYTES
    body_timeout: float = BODY_TIMEOUT_S

    def __repr__(self) -> str:  # never print the keys
        return f"Policy(keys={len(self.keys)}, metrics_auth={self.metrics_auth}, max_bytes={self.max_bytes})"

    def open(self, path: str) -> bool:
        return not self.keys or path in OPEN_PATHS or (path == "/metrics" and not self.metrics_auth)


# --- keys -------------------------------------------------------------------------------------
def read_keys(given: list[str] | None, path: str | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """Keys from --api-key, --api-key-file and the environment, each checked (messages never show
    a key). A file without keys, or an empty variable, is an error rather than no protection."""
    keys = [_checked(k, "--api-key") for k in given or ()]
    if path is not None:
        keys += _file_keys(path)
    if ENV_KEY in env:
        keys.append(_checked(env[ENV_KEY].strip(), ENV_KEY))
    return tuple(dict.fromkeys(keys))


def _file_keys(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise BatchspecError(f"--api-key-file {path}: cannot read it ({err.__class__.__name__}: {err})") from None
    keys = [
        _checked(line.strip(), f"--api-key-file {path} line {i}")
        for i, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not keys:
        raise BatchspecError(f"--api-key-file {path} holds no keys (one per line; blank and # lines are skipped)")
    return keys


def _checked(key: str, source: str) -> str:
    if not key:
        raise BatchspecError(f"{source}: the key is empty")
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise BatchspecError(f"{source}: a key must be printable ASCII without spaces")
    return key


def check_binding(host: str, keys: tuple[str, ...], require: bool) -> str | None:
    """Without keys: an error with `require` (whatever the host), else a warning when `host` is
    reachable from other machines (not loopback), else None."""
    if keys:
        return None
    if require:
        raise BatchspecError(f"--require-api-key: no API key is set; give --api-key, --api-key-file or {ENV_KEY}")
    if _loopback(host):
        return None
    return (
        f"batchspec: warning: serving on {host} without an API key: anyone who can reach the port can use it "
        f"(set --api-key, --api-key-file or {ENV_KEY}; --require-api-key makes this an error)"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def key_ok(token: bytes | None, keys: tuple[str, ...]) -> bool:
    """Whether `token` is one of `keys`, in time independent of which key and of the token's
    length (digests compared, every key checked)."""
    if token is None:
        return False
    given = hashlib.sha256(token).digest()
    match = False
    for key in keys:
        match |= hmac.compare_digest(given, hashlib.sha256(key.encode()).digest())
    return match


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first `Authorization: Bearer <token>` header, or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


# --- the middleware ---------------------------------------------------------------------------
class Refused(Exception):
    """A request turned away by `Guard`: its status, message, code and metrics outcome."""

    def __init__(self, status: int, message: str, code: str, outcome: str = "invalid"):
        super().__init__(message)
        self.status, self.message, self.code, self.outcome = status, message, code, outcome


class Guard:
    """ASGI middleware enforcing a `Policy` on HTTP requests; the body is read here (bounded in
    bytes and time) and handed on whole. `count(outcome)` is told of every refusal."""

    def __init__(self, app, policy: Policy, count: Callable[[str], None] | None = None):
        self.app, self.policy, self.count = app, policy, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._authorize(scope)
            self._check_headers(scope)
            body = await self._read(receive)
        except Refused as refused:
            if self.count is not None:
                self.count(refused.outcome)
            return await _refuse(send, refused)
        if body is not None:  # None: the client went away
            await self.app(scope, _replay(body, receive), send)

    def _authorize(self, scope) -> None:
        if self.policy.open(scope["path"]):
            return
        token = bearer(scope["headers"])
        if not key_ok(token, self.policy.keys):
            message = (
                "no API key given: send it as 'Authorization: Bearer <key>'"
                if token is None
                else "the API key is not valid"
            )
            raise Refused(401, message, "invalid_api_key", "unauthorized")

    def _check_headers(self, scope) -> None:
        headers = dict(scope["headers"])
        kind = headers.get(b"content-type")
        if scope["method"] == "POST" and kind is not None and not _json_type(kind):
            shown = kind.decode("latin-1")[:100]
            message = f"the request body must be JSON (Content-Type: application/json), got '{shown}'"
            raise Refused(415, message, "unsupported_media_type")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.policy.max_bytes:
            raise self._too_large(f"{int(length)} bytes")

    async def _read(self, receive) -> bytes | None:
        """The whole body, or None if the client disconnected; Refused beyond the bounds."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.policy.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.policy.max_bytes:
                        raise self._too_large(f"over {self.policy.max_bytes} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            message = f"the request body did not arrive within {self.policy.body_timeout:g} s"
            raise Refused(408, message, "request_timeout", "timeout") from None

    def _too_large(self, size: str) -> Refused:
        message = f"the request body has {size}; this server accepts at most {self.policy.max_bytes} bytes"
        return Refused(413, message, "request_too_large", "too_large")


def _json_type(value: bytes) -> bool:
    kind = value.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


def _replay(body: bytes, receive):
    """A receive callable that gives `body` once, then whatever the client sends (a disconnect)."""
    given = False

    async def replay():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(send, refused: Refused) -> None:
    """An OpenAI-shaped error; the connection is closed (its body may be unread)."""
    kind = "invalid_request_error"
    body = {"error": {"message": refused.message, "type": kind, "param": None, "code": refused.code}}
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),
    ]
    if refused.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
