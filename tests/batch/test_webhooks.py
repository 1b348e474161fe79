"""Webhook delivery without a platform: which URLs the policy lets through (SSRF), that nothing is
sent to a refused one, that redirects are not followed, that the connection goes to the address
that was checked, and that the signature is Standard Webhooks as independent verifiers read it
(the `standardwebhooks` package and the openai SDK), not as our own code reads it.

Receivers are real aiohttp servers on 127.0.0.1; no traffic ever leaves the machine (the private
address below is refused before any connection is attempted)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
import pytest_asyncio
from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from modelyard.batch.webhook import Delivery, _post, deliver, event, new_secret
from modelyard.batch.webhook_policy import Target, WebhookPolicy, WebhookRefused, parse_entry

# ----- the policy -----------------------------------------------------------------------------


def test_default_allowlist_is_empty_and_refuses_everything() -> None:
    from modelyard.config import PlatformSettings

    default = PlatformSettings.model_fields["batch_webhook_hosts"].get_default(
        call_default_factory=True
    )
    assert default == []
    policy = WebhookPolicy(default)
    for url in ("http://127.0.0.1:8000/x", "http://localhost/x", "https://example.com/hook"):
        with pytest.raises(WebhookRefused, match="allowlist"):
            policy.check(url)


def test_entries_pair_host_and_port() -> None:
    assert parse_entry("127.0.0.1:8080").port == 8080
    assert parse_entry("hooks.example.com").port is None
    assert parse_entry("[::1]:9000").host == "::1" and parse_entry("[::1]:9000").port == 9000
    assert parse_entry("::1").host == "::1" and parse_entry("::1").port is None
    policy = WebhookPolicy(["127.0.0.1:8080", "localhost"])
    assert policy.check("http://127.0.0.1:8080/hook").addresses == ("127.0.0.1",)
    for url in (
        "http://127.0.0.1:8081/hook",  # another loopback port
        "http://127.0.0.1/hook",  # the scheme's default port, not the entry's
        "http://localhost:8080/hook",  # a bare host means its scheme's default port only
        "https://127.0.0.2:8080/hook",
        "ftp://127.0.0.1:8080/hook",
        "http://user:pw@127.0.0.1:8080/hook",
    ):
        with pytest.raises(WebhookRefused):
            policy.check(url)
    assert policy.check("http://localhost/hook").port == 80


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # shared address space
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "[::1]",
        "[fe80::1]",
        "[fc00::1]",
        "[::]",
        "[ff02::1]",
        "[::ffff:127.0.0.1]",  # IPv4-mapped loopback
        "[::ffff:10.0.0.1]",
    ],
)
def test_wildcards_reach_only_public_addresses(address: str) -> None:
    policy = WebhookPolicy(["*:9", "*"])
    with pytest.raises(WebhookRefused, match="resolves to"):
        policy.check(f"http://{address}:9/hook")
    # The same address allowed explicitly (address and port together) passes.
    assert WebhookPolicy(["*", f"{address}:9"]).check(f"http://{address}:9/hook").port == 9


def test_names_are_checked_by_what_they_resolve_to() -> None:
    assert WebhookPolicy(["*"]).check("http://93.184.215.14/hook").addresses == ("93.184.215.14",)
    with pytest.raises(WebhookRefused, match="resolves to 127"):
        WebhookPolicy(["*:9"]).check("http://localhost:9/hook")
    with pytest.raises(WebhookRefused, match="does not resolve"):
        WebhookPolicy(["*"]).check("http://nowhere.invalid/hook")
    with pytest.raises(WebhookRefused, match="allowlist"):
        WebhookPolicy(["*.example.com"]).check("http://example.com.evil.test/hook")
    # An exact host:port entry is trusted wherever it resolves.
    assert "127.0.0.1" in WebhookPolicy(["localhost:9"]).check("http://localhost:9/h").addresses


# ----- delivery -------------------------------------------------------------------------------


class Receiver:
    """An aiohttp server on 127.0.0.1 that records what it gets and answers `answer()`."""

    def __init__(self, answer: Callable[[], web.StreamResponse] | None = None) -> None:
        self.answer = answer or (lambda: web.Response(status=204))
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((dict(request.headers), await request.read()))
        return self.answer()

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest_asyncio.fixture
async def receivers() -> AsyncIterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        await r.stop()


async def receiver(made: list[Receiver], answer: Callable[[], Any] | None = None) -> Receiver:
    r = await Receiver(answer).start()
    made.append(r)
    return r


PAYLOAD = event({"id": "batch_abc", "object": "batch", "status": "completed"})


async def test_signature_verifies_with_standardwebhooks_and_openai(
    receivers: list[Receiver],
) -> None:
    hook = await receiver(receivers)
    secret = new_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) >= 24
    policy = WebhookPolicy([f"127.0.0.1:{hook.port}"])
    assert await deliver(hook.url, policy, secret, PAYLOAD) is Delivery.DELIVERED
    headers, body = hook.requests[0]
    wanted = {"webhook-id", "webhook-timestamp", "webhook-signature"}
    lower = {k.lower(): v for k, v in headers.items()}
    assert wanted <= set(lower)
    assert Webhook(secret).verify(body, lower)["data"]["id"] == "batch_abc"
    client = openai.OpenAI(api_key="unused", webhook_secret=secret)
    client.webhooks.verify_signature(body, lower)
    unwrapped = client.webhooks.unwrap(body, lower)
    assert unwrapped.type == "batch.completed" and unwrapped.data.id == "batch_abc"
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, lower)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.verify_signature(body, lower, secret=new_secret())
    assert json.loads(body)["object"] == "event"


async def test_another_loopback_port_is_refused_without_a_request(
    receivers: list[Receiver],
) -> None:
    allowed, other = await receiver(receivers), await receiver(receivers)
    policy = WebhookPolicy([f"127.0.0.1:{allowed.port}"])
    assert await deliver(other.url, policy, new_secret(), PAYLOAD) is Delivery.REFUSED
    assert other.requests == []


async def test_redirect_is_not_followed(receivers: list[Receiver]) -> None:
    elsewhere = await receiver(receivers)
    location = f"http://localhost:{elsewhere.port}/stolen"
    redirecting = await receiver(
        receivers, lambda: web.Response(status=307, headers={"location": location})
    )
    policy = WebhookPolicy([f"127.0.0.1:{redirecting.port}"])
    outcome = await deliver(redirecting.url, policy, new_secret(), PAYLOAD, first_delay_s=0.01)
    assert outcome is Delivery.FAILED  # a 3xx is a failed delivery, and a final one
    assert len(redirecting.requests) == 1
    await asyncio.sleep(0.2)  # an absence, watched for a while: no redirect is followed late
    assert elsewhere.requests == []


async def test_a_server_error_is_retried(receivers: list[Receiver]) -> None:
    answers = iter([500, 503, 200])
    hook = await receiver(receivers, lambda: web.Response(status=next(answers)))
    policy = WebhookPolicy([f"127.0.0.1:{hook.port}"])
    outcome = await deliver(hook.url, policy, new_secret(), PAYLOAD, first_delay_s=0.01)
    assert outcome is Delivery.DELIVERED and len(hook.requests) == 3
    # Every try carries the same webhook-id (receivers deduplicate by it).
    assert len({h["webhook-id"] for h, _ in hook.requests}) == 1


async def test_private_address_is_refused_before_any_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[Any] = []
    loop = asyncio.get_running_loop()
    real = loop.create_connection

    async def watched(*args: Any, **kwargs: Any) -> Any:
        attempts.append((args, kwargs))
        return await real(*args, **kwargs)

    monkeypatch.setattr(loop, "create_connection", watched)
    policy = WebhookPolicy(["*:9", "*"])
    for url in ("http://10.0.0.1:9/hook", "http://[::ffff:10.0.0.1]:9/hook", "http://10.0.0.1/"):
        assert await deliver(url, policy, new_secret(), PAYLOAD) is Delivery.REFUSED
    assert attempts == []


async def test_connection_goes_to_the_checked_address(receivers: list[Receiver]) -> None:
    """The host is not looked up again when connecting (DNS rebinding): a name that does not
    resolve at all is reached at the address the check returned, with its Host header."""
    hook = await receiver(receivers)
    target = Target(
        url=f"http://rebind.invalid:{hook.port}/hook",
        scheme="http",
        host="rebind.invalid",
        port=hook.port,
        addresses=("127.0.0.1",),
    )
    assert await _post(target, b"{}", {"content-type": "application/json"}) == 204
    assert hook.requests[0][0]["Host"] == f"rebind.invalid:{hook.port}"
