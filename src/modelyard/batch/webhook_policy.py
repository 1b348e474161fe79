"""Which webhook URLs the platform may call: the allowlist and the address check (SSRF defence).

A tenant names the URL (`metadata.webhook_url`), so the platform must not become the tenant's
way into its own network. The operator lists `host:port` entries (`MODELYARD_BATCH_WEBHOOK_HOSTS`);
the list is empty by default, so no tenant URL is called until one is configured. An entry is

- `host` or `host:port` (a name or an IP literal, `[v6]:port` for IPv6): that host on that port
  (without a port: the URL scheme's default, 80 or 443). Exact entries are trusted wherever the
  name resolves, loopback and private networks included;
- `*.example.com[:port]` or `*[:port]`: any such host, but only at public addresses.

The URL's host is resolved when it is checked and every address must pass: loopback, private,
link-local, multicast, reserved and unspecified addresses (IPv6 and IPv4-mapped ones too) are
refused unless the host:port or the address:port is an exact entry. The checked addresses are
returned so that the caller connects to exactly them (no second lookup that DNS could rebind).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_DEFAULT_PORTS = {"http": 80, "https": 443}


class WebhookRefused(ValueError):
    """The URL may not be called; the message says why (safe to show to the tenant)."""


@dataclass(frozen=True)
class AllowEntry:
    host: str  # normalised name or IP, "*" (any host) or "*.suffix"
    port: int | None  # None: the URL scheme's default port

    def matches_port(self, port: int, scheme: str) -> bool:
        return port == (self.port if self.port is not None else _DEFAULT_PORTS[scheme])

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*")


@dataclass(frozen=True)
class Target:
    """A URL that passed the check, and the addresses its host resolved to then."""

    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple[str, ...]


def _normal_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def parse_entry(entry: str) -> AllowEntry:
    """`host`, `host:port`, `[v6]`, `[v6]:port`, a bare IPv6 address, `*`, `*.suffix[:port]`."""
    text = entry.strip()
    port: int | None = None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"bad webhook allowlist entry {entry!r}")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = int(port_text)
    else:  # a name, an IPv4 address or a bare IPv6 address
        host = text
    if not host or (port is not None and not 0 < port < 65536):
        raise ValueError(f"bad webhook allowlist entry {entry!r}")
    return AllowEntry(_normal_host(host), port)


def _public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _public(ip.ipv4_mapped)
    return not (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global  # shared address space (100.64/10), documentation ranges, …
    )


def _resolve(host: str, port: int) -> tuple[str, ...]:
    try:
        return (str(ipaddress.ip_address(host)),)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise WebhookRefused(f"the webhook host {host!r} does not resolve") from exc
    # Dict keys keep getaddrinfo's order (the system's preference) without repeats.
    return tuple(dict.fromkeys(str(info[4][0]).split("%", 1)[0] for info in infos))


class WebhookPolicy:
    def __init__(self, entries: list[str]) -> None:
        self.entries = [parse_entry(e) for e in entries]

    def _exact(self, host: str, port: int, scheme: str) -> bool:
        return any(
            e.host == host and e.matches_port(port, scheme) for e in self.entries if not e.wildcard
        )

    def _wild(self, host: str, port: int, scheme: str) -> bool:
        return any(
            e.matches_port(port, scheme) and (e.host == "*" or host.endswith(e.host[1:]))
            for e in self.entries
            if e.wildcard
        )

    def check(self, url: str, trusted: bool = False) -> Target:
        """The URL's target if it may be called now; raises `WebhookRefused` otherwise. Blocks
        on DNS: call it from a thread. `trusted`: the operator's own URL, which skips the
        allowlist and the address check (it is still resolved once and pinned)."""
        try:
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            port = parts.port
        except ValueError as exc:
            raise WebhookRefused("the webhook URL is not a valid URL") from exc
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise WebhookRefused("the webhook URL must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise WebhookRefused("the webhook URL may not carry credentials")
        host = _normal_host(parts.hostname)
        port = port if port is not None else _DEFAULT_PORTS[scheme]
        exact = trusted or self._exact(host, port, scheme)
        if not exact and not self._wild(host, port, scheme):
            raise WebhookRefused(
                f"{host}:{port} is not in the platform's webhook allowlist "
                "(MODELYARD_BATCH_WEBHOOK_HOSTS)"
            )
        addresses = _resolve(host, port)
        if not addresses:
            raise WebhookRefused(f"the webhook host {host!r} does not resolve")
        for address in addresses:
            ip = ipaddress.ip_address(address)
            if not exact and not _public(ip) and not self._exact(str(ip), port, scheme):
                raise WebhookRefused(
                    f"the webhook host {host!r} resolves to {ip}, a loopback, private or "
                    "reserved address that is not allowlisted"
                )
        return Target(url, scheme, host, port, addresses)
