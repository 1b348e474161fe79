"""`modelyard models list|show|delete` (the registry; `models push` uploads, in `cli.py`),
`modelyard models make-classifier` (a small classifier folder made from an embedding model),
`modelyard devices` (the fleet) and `modelyard webhooks secret` — the admin tasks that are not a
tenant, key, endpoint or batch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from modelyard.cli_commands import common
from modelyard.cli_commands.output import (
    api_errors,
    console,
    details,
    field,
    print_json,
    show,
    when,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
webhooks_app = typer.Typer(no_args_is_help=True, help="Batch webhooks: the signing secret.")


def _size(n: Any) -> str:
    if not isinstance(n, int):
        return "-"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


# One row per version: a model with three versions is three rows, newest last.
VERSION_COLUMNS = [
    ("REF", field("ref")),
    ("ID", field("id")),
    ("FORMAT", field("format")),
    ("BASE", field("base_model")),
    ("SIZE", lambda v: _size(v.get("total_size"))),
    ("CREATED", lambda v: when(v.get("created_at"))),
]


def models_list(as_json: JsonFlag = False) -> None:
    """The registry's models and their versions (this key's tenant)."""
    with api_errors(), common.client() as c:
        models = c.get("/v1/registry/models")["data"]
    if as_json:
        print_json(models)
        return
    rows = [v for m in models for v in m.get("versions") or []]
    show(rows, VERSION_COLUMNS, "Registry", False)


ADAPTER_COLUMNS = [
    ("NAME", field("name")),
    ("BASE", field("base_model")),
    ("VERSIONS", lambda a: ", ".join(map(str, a.get("versions") or []))),
    ("ENDPOINT", field("endpoint_id")),
    ("STATE", field("state")),
]


def models_adapters(as_json: JsonFlag = False) -> None:
    """This tenant's LoRA adapters served on shared bases: base, versions, loaded or cold."""
    with api_errors(), common.client() as c:
        rows = c.get("/v1/registry/adapters")["data"]
    if as_json:
        print_json(rows)
        return
    show(rows, ADAPTER_COLUMNS, "Adapters", False)


def models_show(name: str, as_json: JsonFlag = False) -> None:
    """One model: its versions, their format and size."""
    with api_errors(), common.client() as c:
        model = c.get(f"/v1/registry/models/{name}")
    if as_json:
        print_json(model)
        return
    show(model.get("versions") or [], VERSION_COLUMNS, f"{name} ({model.get('id')})", False)


def models_delete(name: str) -> None:
    """Delete a model and all its versions (refused while an endpoint serves one)."""
    with api_errors(), common.client() as c:
        c.delete(f"/v1/registry/models/{name}")
    console.print(f"deleted {name}")


DEVICE_COLUMNS = [
    ("DEVICE", field("name")),
    ("KIND", field("kind")),
    ("USED", lambda d: _size(d.get("used_bytes"))),
    ("MEMORY", lambda d: _size(d.get("memory_bytes"))),
    ("REPLICAS", lambda d: ", ".join(d.get("replicas") or []) or "-"),
]


def devices(as_json: JsonFlag = False) -> None:
    """The fleet: each device, its memory in use and the replicas placed on it (platform admin)."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/devices")["data"], DEVICE_COLUMNS, "Devices", as_json)


@webhooks_app.command("secret")
def webhooks_secret(
    rotate: Annotated[
        bool, typer.Option("--rotate", help="Make a new one (the old stops signing at once).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """The secret this tenant's batch webhooks are signed with (`whsec_…`)."""
    with api_errors(), common.client() as c:
        secret = c.post("/v1/webhooks/secret/rotate") if rotate else c.get("/v1/webhooks/secret")
    details(secret, as_json)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def make_classifier(
    out: Annotated[Path, typer.Argument(help="The folder to write (push or deploy it after).")],
    label: Annotated[
        list[str] | None,
        typer.Option(
            help="A label and its description, NAME=WORDS (repeat it); default: positive and "
            "negative sentiment."
        ),
    ] = None,
    from_model: Annotated[
        str, typer.Option("--from", help="The embedding model: a bundled name or a folder.")
    ] = "all-minilm-l6-v2",
) -> None:
    """Make a small classifier from an embedding model, with no training: each text gets the
    label whose description it is closest to (an ONNX classifier folder)."""
    from modelyard.encoders.errors import EncoderError
    from modelyard.encoders.zero_shot import DEFAULT_LABELS, make_classifier
    from modelyard.engine.models.bundled import ModelNotFoundError, resolve_model_path

    labels = dict(DEFAULT_LABELS)
    if label:
        pairs = [item.partition("=") for item in label]
        bad = [name for name, eq, words in pairs if not (name and eq and words.strip())]
        if bad:
            raise _fail(f"--label takes NAME=WORDS, got {bad[0]!r}")
        labels = {name: words for name, _, words in pairs}
    try:
        folder = make_classifier(resolve_model_path(from_model), out, labels)
    except (ModelNotFoundError, EncoderError) as exc:
        raise _fail(str(exc)) from exc
    typer.secho(f"wrote {folder} (labels: {', '.join(labels)})", fg=typer.colors.GREEN)
