"""Where the platform's Redis is, from `redis_url`: one server (`redis://`, `rediss://`,
`unix://`, as redis-py reads them) or the Sentinels that know the current primary
(`redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE_NAME[/DB]`). Parsed and bounded once, at
startup: a URL this cannot read stops the process with a message that says what is wrong."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
MAX_URL_CHARS = 2048
MAX_SENTINELS = 16
MAX_DB = 65535
SERVER_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE_NAME[/DB]"

_HOST = re.compile(
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45})\]|(?P<name>[A-Za-z0-9._-]{1,253}))(?::(?P<port>[0-9]{1,5}))?"
)
_SERVICE = re.compile(r"[A-Za-z0-9._-]{1,128}")


class RedisUrlError(ValueError):
    """`redis_url` cannot be read (said in one line, with the form expected)."""


@dataclass(frozen=True)
class SentinelTarget:
    """The Sentinels to ask, the primary's service name there, and how to talk to it."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None  # the primary's (and replicas'), not the Sentinels'


def parse_redis_url(url: str) -> str | SentinelTarget:
    """A one-server URL as it is (redis-py parses it), or the Sentinel URL's parts."""
    if len(url) > MAX_URL_CHARS:
        raise RedisUrlError(f"redis_url is {len(url)} characters long, over {MAX_URL_CHARS}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise RedisUrlError(f"redis_url {_shown(url)} has no scheme: use redis://HOST:PORT[/DB] "
                            f"or {SENTINEL_FORM}")  # fmt: skip
    if scheme.lower() in SERVER_SCHEMES:
        return url
    if scheme.lower() != SENTINEL_SCHEME:
        raise RedisUrlError(f"redis_url scheme {scheme[:32]!r} is not one of redis, rediss, "
                            f"unix or {SENTINEL_SCHEME}")  # fmt: skip
    return _parse_sentinel(rest, url)


def _parse_sentinel(rest: str, url: str) -> SentinelTarget:
    def bad(why: str) -> RedisUrlError:
        return RedisUrlError(f"redis_url {_shown(url)}: {why} (expected {SENTINEL_FORM})")

    if "?" in rest or "#" in rest:
        raise bad("query strings and fragments are not read")
    userinfo, at, rest = rest.rpartition("@")
    if not at:
        userinfo = ""
    hosts, slash, path = rest.partition("/")
    if not slash or not path:
        raise bad("no SERVICE_NAME after the hosts")
    sentinels = tuple(_host(part, bad) for part in hosts.split(","))
    if len(sentinels) > MAX_SENTINELS:
        raise bad(f"{len(sentinels)} Sentinels, over {MAX_SENTINELS}")
    service, _, db_text = path.partition("/")
    if not _SERVICE.fullmatch(service):
        raise bad(f"SERVICE_NAME {service[:40]!r} is not 1-128 letters, digits, '.', '_', '-'")
    db = 0
    if db_text:
        if not db_text.isascii() or not db_text.isdigit() or int(db_text[:6]) > MAX_DB:
            raise bad(f"DB {db_text[:20]!r} is not a number from 0 to {MAX_DB}")
        db = int(db_text)
    username, _, password = userinfo.partition(":")
    return SentinelTarget(
        sentinels=sentinels,
        service_name=service,
        db=db,
        username=unquote(username) or None,
        password=unquote(password) or None,
    )


def _host(part: str, bad: Callable[[str], RedisUrlError]) -> tuple[str, int]:
    match = _HOST.fullmatch(part)
    if match is None:
        raise bad(f"{part[:60]!r} is not HOST:PORT")
    port = int(match["port"]) if match["port"] else DEFAULT_SENTINEL_PORT
    if not 0 < port < 65536:
        raise bad(f"port {port} of {part[:60]!r} is not 1-65535")
    return match["v6"] or match["name"], port


def _shown(url: str) -> str:
    """The URL for an error message, its password masked."""
    masked = re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", url)
    return repr(masked[:200])
