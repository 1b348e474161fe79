"""`modelyard deploy` and `modelyard endpoints list|show|delete|rollout|traffic|promote|rollback`.

A deploy or rollout follows the endpoint (`GET /v1/endpoints/{id}`) until it serves or fails: one
live line redrawn in place on a terminal (status, replicas with their load progress, traffic), a
plain line per change otherwise. A rollout with `--weight` adds a canary beside the stable
version (`POST /v1/endpoints/{id}/versions`); without it the whole endpoint moves to the version
(`PATCH /v1/endpoints/{id}`). `traffic`, `promote` and `rollback` move traffic between versions.
How an endpoint is drawn lives in `endpoint_tables`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from modelyard.cli_commands import common
from modelyard.cli_commands.client import ApiError, PlatformClient
from modelyard.cli_commands.endpoint_tables import (
    ENDPOINT_COLUMNS,
    progress_line,
    replica_counts,
    replica_items,
    show_endpoint,
    traffic_summary,
    versions_of,
)
from modelyard.cli_commands.output import api_errors, console, print_json, safe, show
from modelyard.core.status import EndpointStatus

endpoints_app = typer.Typer(no_args_is_help=True, help="Deployed endpoints.")
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
Timeout = Annotated[float, typer.Option(help="Seconds to wait for ready.")]

# Where a deploy stops waiting: it serves, or it cannot come up as things are.
SERVING = frozenset({EndpointStatus.READY})
STUCK = frozenset({EndpointStatus.FAILED, EndpointStatus.UNSCHEDULABLE, EndpointStatus.DELETED})

# A view -> True (done), False (failed: it will not get there), None (keep waiting).
Outcome = Callable[[dict[str, Any]], bool | None]


def status_of(view: dict[str, Any]) -> EndpointStatus | None:
    try:
        return EndpointStatus(str(view.get("status")))
    except ValueError:  # a status newer than this CLI
        return None


def _replicas(view: dict[str, Any]) -> str:
    """`ready/desired` (serve's own load progress reads it too)."""
    return replica_counts(view)


def _states(view: dict[str, Any]) -> str:
    return ", ".join(str(i.get("state")) for i in replica_items(view))


def _starting(view: dict[str, Any], version_id: str | None = None) -> bool:
    return any(
        i.get("state") == "starting"
        for i in replica_items(view)
        if version_id is None or i.get("version_id") == version_id
    )


def deployed(view: dict[str, Any]) -> bool | None:
    status = status_of(view)
    if status in SERVING:
        return True
    return False if status in STUCK else None


def rolled_out(target: str | None) -> Outcome:
    """A whole-endpoint rollout to `target` is done when the endpoint serves it alone; it failed
    when the endpoint fell back to another version (or is stuck)."""

    def outcome(view: dict[str, Any]) -> bool | None:
        if status_of(view) in STUCK:
            return False
        if status_of(view) not in SERVING or view.get("rollout_from") or _starting(view):
            return None
        return target is None or view.get("version_id") == target

    return outcome


def canary_up(target: str | None) -> Outcome:
    """A canary is up when a replica of its version serves and none is still starting; it
    failed when its version left the endpoint (rolled back) or the endpoint is stuck."""

    def outcome(view: dict[str, Any]) -> bool | None:
        if status_of(view) in STUCK:
            return False
        if target is None:
            return None if _starting(view) or status_of(view) not in SERVING else True
        if target not in versions_of(view):
            return False
        serving = any(
            i.get("state") == "ready" and i.get("version_id") == target for i in replica_items(view)
        )
        return True if serving and not _starting(view, target) else None

    return outcome


def wait_for(
    c: PlatformClient,
    endpoint_id: str,
    timeout: float,
    outcome: Outcome = deployed,
    quiet: bool = False,
    interval: float = 0.5,
) -> tuple[dict[str, Any], bool]:
    """Poll the endpoint until `outcome` decides: on a terminal one live line redrawn in place;
    otherwise (logs, CI, pipes) a plain line each time the status or replicas change. Returns
    the last view and whether it succeeded."""
    started = time.monotonic()
    spinner = Spinner("dots", text="waiting…")
    live = console.is_terminal and not quiet
    last: tuple[Any, ...] | None = None
    with (
        Live(spinner, console=console, transient=True, refresh_per_second=8)
        if live
        else (nullcontext())
    ):
        while True:
            view: dict[str, Any] = c.get(f"/v1/endpoints/{endpoint_id}")
            done = outcome(view)
            line = progress_line(view, time.monotonic() - started)
            mark = (view.get("status"), replica_counts(view), line.split(" · ")[1])
            if live:
                spinner.update(text=Text.from_markup(line))
            elif mark != last and done is None and not quiet:
                console.print(line, highlight=False)
            last = mark
            if done is not None:
                return view, done
            if time.monotonic() - started > timeout:
                raise ApiError(0, f"not ready after {timeout:.0f}s: {line}")
            time.sleep(interval)


def wait_ready(
    c: PlatformClient, endpoint_id: str, timeout: float, quiet: bool = False, interval: float = 0.5
) -> dict[str, Any]:
    """Follow a deploy until the endpoint serves or is stuck; the last view."""
    return wait_for(c, endpoint_id, timeout, deployed, quiet, interval)[0]


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(1)


def deploy(
    name: Annotated[str, typer.Argument(help="The model name clients will call.")],
    artifact: Annotated[str, typer.Argument(help="Registry NAME[:VERSION], or a local path.")],
    public: Annotated[bool, typer.Option(help="Visible to every tenant (platform admin).")] = False,
    min_replicas: Annotated[int | None, typer.Option(min=0)] = None,
    max_replicas: Annotated[int | None, typer.Option(min=1)] = None,
    scale_to_zero: Annotated[bool | None, typer.Option()] = None,
    wait: Annotated[bool, typer.Option(help="Follow the load until it serves.")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for ready.")] = 900.0,
    as_json: JsonFlag = False,
) -> None:
    """Deploy a model and follow its load until it serves (exit 1 if it fails)."""
    body: dict[str, Any] = {"model_name": name, "model_artifact": artifact, "public": public}
    hardware = {k: v for k, v in (("min_replicas", min_replicas), ("max_replicas", max_replicas))
                if v is not None}  # fmt: skip
    if hardware:
        body["hardware"] = hardware
    if scale_to_zero is not None:
        body["scaling"] = {"scale_to_zero": scale_to_zero}
    started = time.monotonic()
    with api_errors(), common.client() as c:
        created = c.post("/v1/models/deploy", body)
        endpoint_id = created["endpoint_id"]
        if not as_json:
            console.print(f"deploying [bold]{name}[/bold] as endpoint {endpoint_id}")
        if not wait:
            if as_json:
                print_json(created)
            return
        view = wait_ready(c, endpoint_id, timeout, quiet=as_json)  # stdout: the JSON alone
    status = status_of(view)
    if as_json:
        print_json(view)
    elif status in SERVING:
        console.print(f"[green]✓[/green] {progress_line(view, time.monotonic() - started)}")
    if status not in SERVING:
        reason = view.get("status_message") or (view.get("replicas") or {}).get("last_error")
        typer.secho(f"error: {name} is {view.get('status')}: {reason or 'no reason given'}",
                    fg=typer.colors.RED, err=True)  # fmt: skip
        raise typer.Exit(1)


@endpoints_app.command("list")
def endpoints_list(as_json: JsonFlag = False) -> None:
    """Endpoints this key can see."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/endpoints")["data"], ENDPOINT_COLUMNS, "Endpoints", as_json)


@endpoints_app.command("show")
def endpoints_show(endpoint_id: str, as_json: JsonFlag = False) -> None:
    """One endpoint: status, versions with weights and replicas, the canary, its replicas."""
    with api_errors(), common.client() as c:
        view = c.get(f"/v1/endpoints/{endpoint_id}")
    if as_json:
        print_json(view)
    else:
        show_endpoint(view)


@endpoints_app.command("delete")
def endpoints_delete(endpoint_id: str, as_json: JsonFlag = False) -> None:
    """Drain and delete an endpoint."""
    with api_errors(), common.client() as c:
        result = c.delete(f"/v1/endpoints/{endpoint_id}")
    if as_json:
        print_json(result)
    else:
        console.print(f"{endpoint_id}: {result.get('status')}")


def _target_of(answer: dict[str, Any]) -> str | None:
    """The version a rollout or new canary answer names (`version_id`, or a version object)."""
    version = answer.get("version") or answer.get("canary")  # the versions API: its canary
    nested = version.get("version_id") if isinstance(version, dict) else None
    own = answer.get("id") if answer.get("object") != "endpoint" else None
    for value in (answer.get("version_id"), nested, own):
        if isinstance(value, str) and value:
            return value
    return None


@endpoints_app.command("rollout")
def endpoints_rollout(
    endpoint_id: str,
    artifact: Annotated[str, typer.Argument(help="Registry NAME[:VERSION] to roll out.")],
    weight: Annotated[
        int | None,
        typer.Option(min=1, max=100, help="Add it as a canary with this % of traffic."),
    ] = None,
    replicas: Annotated[int | None, typer.Option(min=1, help="The canary's replicas.")] = None,
    wait: Annotated[bool, typer.Option(help="Follow it until it serves.")] = True,
    timeout: Timeout = 900.0,
    as_json: JsonFlag = False,
) -> None:
    """Roll an endpoint out to a registry version: all of it, or (--weight) a canary beside the
    stable version; follow it until it serves (exit 1 if it fails or is rolled back)."""
    if replicas is not None and weight is None:
        raise _fail("--replicas is for a canary: give --weight too")
    with api_errors(), common.client() as c:
        if weight is None:
            answer = c.patch(f"/v1/endpoints/{endpoint_id}", {"model_artifact": artifact})
            outcome = rolled_out(_target_of(answer))
        else:
            body: dict[str, Any] = {"model_artifact": artifact, "weight": weight}
            if replicas is not None:
                body["replicas"] = replicas
            answer = c.post(f"/v1/endpoints/{endpoint_id}/versions", body)
            outcome = canary_up(_target_of(answer))
        what = f"a {weight}% canary of {artifact}" if weight else artifact
        if not as_json:
            console.print(f"rolling [bold]{endpoint_id}[/bold] out to {what}")
        if not wait:
            if as_json:
                print_json(answer)
            return
        started = time.monotonic()
        view, ok = wait_for(c, endpoint_id, timeout, outcome, quiet=as_json)
    if as_json:
        print_json(view)
    elif ok:
        console.print(f"[green]✓[/green] {progress_line(view, time.monotonic() - started)}")
    if not ok:
        reason = view.get("status_message") or (view.get("replicas") or {}).get("last_error")
        raise _fail(
            f"rollout of {artifact} did not complete: {view.get('model_name')} is "
            f"{view.get('status')} on {traffic_summary(view)}: {reason or 'no reason given'}"
        )


def _moved(view: dict[str, Any], verb: str, as_json: bool) -> None:
    if as_json:
        print_json(view)
    else:
        summary = safe(traffic_summary(view))
        console.print(f"{safe(view.get('endpoint_id'))}: {verb} · traffic {summary}")


def _parse_weights(pairs: list[str]) -> dict[str, int]:
    weights: dict[str, int] = {}
    for pair in pairs:
        version, sep, pct = pair.rpartition("=")
        if not sep or not version or not pct.strip().isdigit():
            raise _fail(f"{pair!r}: give each weight as VERSION=PERCENT, e.g. mv-1a2b=90")
        weights[version] = int(pct)
    if sum(weights.values()) != 100:
        raise _fail(f"the weights add up to {sum(weights.values())}, not 100")
    return weights


@endpoints_app.command("traffic")
def endpoints_traffic(
    endpoint_id: str,
    weights: Annotated[
        list[str], typer.Argument(help="VERSION=PERCENT for each version (they add up to 100).")
    ],
    as_json: JsonFlag = False,
) -> None:
    """Set how traffic splits between the endpoint's versions."""
    body = {"weights": _parse_weights(weights)}
    with api_errors(), common.client() as c:
        c.patch(f"/v1/endpoints/{endpoint_id}/traffic", body)
        view = c.get(f"/v1/endpoints/{endpoint_id}")
    _moved(view, "traffic set", as_json)


@endpoints_app.command("promote")
def endpoints_promote(endpoint_id: str, as_json: JsonFlag = False) -> None:
    """Make the canary the stable version (all traffic; the old one stays warm a while)."""
    with api_errors(), common.client() as c:
        c.post(f"/v1/endpoints/{endpoint_id}/promote")
        view = c.get(f"/v1/endpoints/{endpoint_id}")
    _moved(view, "promoted", as_json)


@endpoints_app.command("rollback")
def endpoints_rollback(
    endpoint_id: str,
    reason: Annotated[str | None, typer.Option(help="Why (kept on the endpoint).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Send all traffic back at once: to the stable version while a canary runs, else to the
    previous version (kept warm for a while after a promotion). Nothing is loaded."""
    with api_errors(), common.client() as c:
        answer = c.post(
            f"/v1/endpoints/{endpoint_id}/rollback", {"reason": reason} if reason else None
        )
        view = c.get(f"/v1/endpoints/{endpoint_id}")
    took = answer.get("took_ms")
    _moved(view, "rolled back" + (f" in {took} ms" if took is not None else ""), as_json)
