"""`modelyard deploy` (with a live progress line while the endpoint loads) and
`modelyard endpoints list|show|delete`.

Loading progress is what `GET /v1/endpoints/{id}` reports: the status, its message, and each
replica's state; there is no percentage, so the line shows those and the time elapsed.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from modelyard.cli_commands import common
from modelyard.cli_commands.client import ApiError, PlatformClient
from modelyard.cli_commands.output import api_errors, console, details, field, print_json, show
from modelyard.core.status import EndpointStatus

endpoints_app = typer.Typer(no_args_is_help=True, help="Deployed endpoints.")
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

# Where a deploy stops waiting: it serves, or it cannot come up as things are.
SERVING = frozenset({EndpointStatus.READY})
STUCK = frozenset({EndpointStatus.FAILED, EndpointStatus.UNSCHEDULABLE, EndpointStatus.DELETED})


def status_of(view: dict[str, Any]) -> EndpointStatus | None:
    try:
        return EndpointStatus(view.get("status"))
    except ValueError:  # a status newer than this CLI
        return None


def _replicas(view: dict[str, Any]) -> str:
    r = view.get("replicas") or {}
    return f"{r.get('ready', 0)}/{r.get('desired', 0)}"


def _states(view: dict[str, Any]) -> str:
    items = (view.get("replicas") or {}).get("items") or []
    return ", ".join(str(i.get("state")) for i in items)


def progress_line(view: dict[str, Any], elapsed: float) -> str:
    """`tiny: provisioning · replicas 0/1 (starting) · 12s · <status message>`."""
    states = _states(view)
    parts = [f"{view.get('model_name')}: {view.get('status')}",
             f"replicas {_replicas(view)}" + (f" ({states})" if states else ""),
             f"{elapsed:.0f}s"]  # fmt: skip
    if view.get("status_message"):
        parts.append(str(view["status_message"]))
    return " · ".join(parts)


def wait_ready(
    c: PlatformClient, endpoint_id: str, timeout: float, quiet: bool = False, interval: float = 0.5
) -> dict:
    """Poll the endpoint until it serves or is stuck: on a terminal one live line redrawn in
    place; otherwise (logs, CI, pipes) a plain line each time the status or replicas change."""
    started = time.monotonic()
    spinner = Spinner("dots", text="deploying…")
    live = console.is_terminal and not quiet
    last: tuple[Any, ...] | None = None
    with (
        Live(spinner, console=console, transient=True, refresh_per_second=8)
        if live
        else (nullcontext())
    ):
        while True:
            view: dict[str, Any] = c.get(f"/v1/endpoints/{endpoint_id}")
            status = status_of(view)
            line = progress_line(view, time.monotonic() - started)
            mark = (view.get("status"), _replicas(view), _states(view))
            if live:
                spinner.update(text=Text(line))
            elif mark != last and status not in SERVING and not quiet:
                console.print(line, highlight=False)
            last = mark
            if status in SERVING or status in STUCK:
                return view
            if time.monotonic() - started > timeout:
                raise ApiError(0, f"not ready after {timeout:.0f}s: {line}")
            time.sleep(interval)


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


ENDPOINT_COLUMNS = [
    ("ID", field("endpoint_id")),
    ("MODEL", field("model_name")),
    ("KIND", field("kind")),
    ("STATUS", field("status")),
    ("REPLICAS", _replicas),
    ("PUBLIC", field("public")),
    ("ARTIFACT", field("model_artifact")),
]


@endpoints_app.command("list")
def endpoints_list(as_json: JsonFlag = False) -> None:
    """Endpoints this key can see."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/endpoints")["data"], ENDPOINT_COLUMNS, "Endpoints", as_json)


@endpoints_app.command("show")
def endpoints_show(endpoint_id: str, as_json: JsonFlag = False) -> None:
    """One endpoint: status, replicas, versions, autoscaling."""
    with api_errors(), common.client() as c:
        details(c.get(f"/v1/endpoints/{endpoint_id}"), as_json)


@endpoints_app.command("delete")
def endpoints_delete(endpoint_id: str, as_json: JsonFlag = False) -> None:
    """Drain and delete an endpoint."""
    with api_errors(), common.client() as c:
        result = c.delete(f"/v1/endpoints/{endpoint_id}")
    if as_json:
        print_json(result)
    else:
        console.print(f"{endpoint_id}: {result.get('status')}")
