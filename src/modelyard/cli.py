"""`modelyard …`: the command line (typer + rich). Errors are one clear line, not a traceback.

The process commands (`serve`, `worker`, `encoders`) live here; the admin commands (over HTTP
to a running platform) in `modelyard.cli_commands`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from modelyard.cli_commands import admin, audit, chat, common, data, endpoints, registry
from modelyard.cli_commands.budgets import budgets_app, prices_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="modelyard inference platform")
models_app = typer.Typer(
    no_args_is_help=True, help="The model registry (push, list, show, delete); the models served."
)
app.add_typer(models_app, name="models")
app.command()(admin.login)
app.command()(admin.whoami)
app.add_typer(admin.tenants_app, name="tenants")
app.add_typer(admin.keys_app, name="keys")
app.add_typer(admin.usage_app, name="usage")
app.add_typer(budgets_app, name="budgets")
app.add_typer(prices_app, name="prices")
app.command()(endpoints.deploy)
app.add_typer(endpoints.endpoints_app, name="endpoints")
app.add_typer(audit.audit_app, name="audit")
app.add_typer(data.files_app, name="files")
app.add_typer(data.batches_app, name="batches")
app.command()(chat.chat)
models_app.command("list")(registry.models_list)
models_app.command("show")(registry.models_show)
models_app.command("adapters")(registry.models_adapters)
models_app.command("delete")(registry.models_delete)
models_app.command("served")(chat.models_served)
models_app.command("make-classifier")(registry.make_classifier)
app.command()(registry.devices)
app.add_typer(registry.webhooks_app, name="webhooks")


@app.callback()
def main(
    profile: Annotated[
        str | None, typer.Option(help="Profile of config.toml (default: its default_profile).")
    ] = None,
    url: Annotated[str | None, typer.Option(help="Platform URL (over MODELYARD_URL).")] = None,
    api_key: Annotated[
        str | None, typer.Option(help="API key (over MODELYARD_API_KEY).", show_default=False)
    ] = None,
) -> None:
    """modelyard inference platform. The admin commands find the platform's URL and key in
    --url/--api-key, then MODELYARD_URL/MODELYARD_API_KEY, then the profile of
    $XDG_CONFIG_HOME/modelyard/config.toml (`modelyard login` writes it)."""
    common.selection = common.Selection(profile, url, api_key)


def _setup_logging(level: str | None, suffix: str = "", replica: bool = False) -> Any:
    """Logs (text or JSON lines) and traces (with `otel_endpoint`; the service name is
    `otel_service_name` + `suffix`) of this process, from the telemetry settings, `level` (a
    --log-level) over theirs; returns the effective settings."""
    from pydantic import ValidationError

    from modelyard.config import TelemetrySettings
    from modelyard.core.logs import setup_logging
    from modelyard.core.tracing import configure_tracing

    try:
        overrides: dict[str, Any] = {"log_level": level} if level else {}
        settings = TelemetrySettings(**overrides)
        setup_logging(settings, replica=replica)
        configure_tracing(settings, settings.otel_service_name + suffix)
    except (ValidationError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc
    return settings


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="State: SQLite, artifacts, logs, admin key.")
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="postgresql://… (default: SQLite in the data dir).")
    ] = None,
    default_models: Annotated[
        bool | None, typer.Option(help="Register and deploy the bundled models.")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="Log level (default: the log_level setting, info).")
    ] = None,
) -> None:
    """Run the platform: gateway, control plane and local worker replicas."""
    import asyncio

    import uvicorn

    from modelyard.api.app import create_platform_app
    from modelyard.config import PlatformSettings
    from modelyard.core.gc_pauses import freeze_heap_when_started
    from modelyard.core.redis_url import RedisUrlError
    from modelyard.core.uvicorn_options import uvicorn_options
    from modelyard.platform import Platform

    telemetry = _setup_logging(log_level)
    if log_level:  # the replicas it starts log as it does
        os.environ["MODELYARD_LOG_LEVEL"] = telemetry.log_level
    # Everything serve writes (database, keys, blobs, logs, node cache) is the owner's alone;
    # the start also fixes what an older install left readable (`Platform._secure_files`).
    os.umask(0o077)
    given: dict[str, Any] = {"host": host, "port": port, "data_dir": data_dir,
        "database_url": database_url, "default_models": default_models}  # fmt: skip
    overrides = {k: v for k, v in given.items() if v is not None}
    settings = PlatformSettings(**overrides)
    try:
        platform = Platform(settings)
    except RedisUrlError as exc:
        raise _fail(str(exc)) from exc
    app_ = create_platform_app(platform.services, platform)

    def announce() -> None:
        base = f"http://{settings.host}:{settings.port}"
        boot = platform.bootstrap
        typer.secho(f"\nmodelyard is serving on {base}/v1", fg=typer.colors.GREEN, bold=True)
        if boot is not None and boot.admin_key:
            typer.secho("Admin API key (shown once; also saved, mode 0600, in ", nl=False)
            typer.secho(f"{boot.admin_key_file}):\n  {boot.admin_key}", bold=True)
        elif boot is not None:
            typer.echo(f"Admin API key: in {boot.admin_key_file}")
        models = [r.model_name for r in platform.routing.visible("")]
        if models:
            typer.echo(f"Public models: {', '.join(models)}")
        typer.echo("")

    progress: list[asyncio.Task[None]] = []  # holds the task while it runs

    def ready() -> None:
        """The banner; with default models, after their load progress (they load in the
        background while the server already answers)."""
        boot = platform.bootstrap
        if not settings.default_models or boot is None:
            announce()
            return
        from modelyard.cli_commands.serve_progress import report_loading

        key = boot.admin_key or boot.admin_key_file.read_text().strip()
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        url = f"http://{host}:{settings.port}"
        report = report_loading(url, key, platform.loaded(), announce)
        progress.append(asyncio.get_running_loop().create_task(report))

    platform.on_ready = ready
    freeze_heap_when_started()
    uvicorn.run(
        app_,
        host=settings.host,
        port=settings.port,
        log_level=telemetry.log_level,
        timeout_graceful_shutdown=10,
        **uvicorn_options(telemetry),
    )


_Host = Annotated[str | None, typer.Option(help="Address to listen on.")]
_Port = Annotated[int | None, typer.Option(help="Port to listen on.")]
_DataDir = Annotated[Path | None, typer.Option(help="Logs, usage journal (controller: admin key).")]
_Level = Annotated[str | None, typer.Option(help="Log level (default: the log_level setting).")]


@app.command()
def gateway(host: _Host = None, port: _Port = None, data_dir: _DataDir = None,
            log_level: _Level = None) -> None:  # fmt: skip
    """Cluster mode: a stateless gateway (auth, limits, routing, proxying, metering) on the
    shared PostgreSQL and Redis; control requests go on to the leading controller."""
    _run_role("gateway", host, port, data_dir, log_level)


@app.command()
def controller(host: _Host = None, port: _Port = None, data_dir: _DataDir = None,
               log_level: _Level = None) -> None:  # fmt: skip
    """Cluster mode: the control plane while it holds the leader lease, a standby otherwise;
    run two or more on the shared PostgreSQL and Redis."""
    _run_role("controller", host, port, data_dir, log_level)


def _run_role(kind: str, host: str | None, port: int | None, data_dir: Path | None,
              log_level: str | None) -> None:  # fmt: skip
    import uvicorn

    from modelyard.config import PlatformSettings
    from modelyard.core.gc_pauses import freeze_heap_when_started
    from modelyard.core.redis_url import RedisUrlError
    from modelyard.core.uvicorn_options import uvicorn_options
    from modelyard.roles import ClusterConfigError, ControllerRole, GatewayRole

    telemetry = _setup_logging(log_level, suffix=f"-{kind}")
    if log_level:
        os.environ["MODELYARD_LOG_LEVEL"] = telemetry.log_level
    os.umask(0o077)
    given: dict[str, Any] = {"host": host, "port": port, "data_dir": data_dir}
    settings = PlatformSettings(**{k: v for k, v in given.items() if v is not None})
    try:
        role = GatewayRole(settings) if kind == "gateway" else ControllerRole(settings)
    except (ClusterConfigError, RedisUrlError) as exc:
        raise _fail(str(exc)) from exc
    if isinstance(role, ControllerRole):

        def leading() -> None:
            boot = role.platform.bootstrap
            typer.secho(f"modelyard controller leads at {role.url}", fg=typer.colors.GREEN)
            if boot is not None and boot.admin_key:
                typer.secho("Admin API key (shown once; also saved, mode 0600, in ", nl=False)
                typer.secho(f"{boot.admin_key_file}):\n  {boot.admin_key}", bold=True)

        role.on_leading = leading
    freeze_heap_when_started()
    uvicorn.run(role.asgi(), host=settings.host, port=settings.port,
                log_level=telemetry.log_level, timeout_graceful_shutdown=10,
                **uvicorn_options(telemetry))  # fmt: skip


@app.command()
def worker(
    model: Annotated[
        str, typer.Option(help="Model: a HF folder, a .gguf file, or a bundled name (smollm2).")
    ] = "smollm2",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients use (default: the model's name).")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="auto, float32 or bfloat16.")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option(help="KV cache budget, e.g. 1GiB.")] = None,
    tensor_parallel_size: Annotated[
        int | None,
        typer.Option(help="Split the model over N devices (ranks); starts N-1 helper processes."),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="Log level (default: the log_level setting, info).")
    ] = None,
) -> None:
    """Serve one model over the OpenAI API (chat, completions, models, health, metrics)."""
    from modelyard.config import EngineSettings
    from modelyard.engine.models.bundled import ModelNotFoundError
    from modelyard.engine.models.config import UnsupportedModelError
    from modelyard.worker.server import serve_worker

    log_level = _setup_logging(log_level, "-worker", replica=True).log_level
    overrides: dict[str, object] = {}
    if dtype:
        overrides["dtype"] = dtype
    if kv_cache_memory:
        overrides["kv_cache_memory"] = kv_cache_memory
    if tensor_parallel_size is not None:
        overrides["tensor_parallel_size"] = tensor_parallel_size
    try:
        settings = EngineSettings(**overrides)  # type: ignore[arg-type]
        serve_worker(model, host, port, settings, served_model_name, log_level)
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as exc:
        raise _fail(str(exc)) from exc


@app.command()
def encoders(
    model: Annotated[
        list[str] | None,
        typer.Option(help="NAME=PATH of an embedding or classifier model folder (repeatable)."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    memory_budget: Annotated[str, typer.Option(help="Memory for loaded models.")] = "2GiB",
    max_batch_size: Annotated[int, typer.Option(help="Inputs per batch (1 = none).")] = 32,
    max_wait_ms: Annotated[float, typer.Option(help="How long a batch waits to fill.")] = 5.0,
    device: Annotated[str, typer.Option(help="torch device.")] = "cpu",
    log_level: Annotated[
        str | None, typer.Option(help="Log level (default: the log_level setting, info).")
    ] = None,
) -> None:
    """Serve embedding and classifier models: OpenAI embeddings and the Open Inference Protocol
    v2, several models in one process, loaded on first use, dynamically batched."""
    from modelyard.config import parse_size
    from modelyard.worker.encoder_app import serve_encoders

    log_level = _setup_logging(log_level, "-encoders", replica=True).log_level
    models: dict[str, Path] = {}
    for entry in model or []:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise _fail(f"--model takes NAME=PATH, got {entry!r}")
        if name in models:
            raise _fail(f"model name {name!r} given twice")
        models[name] = Path(path)
    try:
        serve_encoders(
            models, host, port, parse_size(memory_budget), max_batch_size, max_wait_ms,
            device=device, log_level=log_level,
        )  # fmt: skip
    except ValueError as exc:
        raise _fail(str(exc)) from exc


@app.command(hidden=True)
def runtime(
    framework: Annotated[str, typer.Option(help="llama.cpp or vllm.")],
    executable: Annotated[str, typer.Option(help="The runtime's server binary.")],
    model: Annotated[str, typer.Option(help="The model file or folder.")],
    served_model_name: Annotated[str, typer.Option(help="Model name clients use.")],
    slots: Annotated[int, typer.Option(help="Parallel sequences.")] = 8,
    context: Annotated[int | None, typer.Option(help="Tokens per sequence.")] = None,
    runtime_arg: Annotated[list[str] | None, typer.Option(help="Passed to the server.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """A replica run by another runtime (the deploy's framework), behind modelyard's sidecar
    (control/runtimes/sidecar.py); the platform starts it."""
    import argparse

    from modelyard.control.runtimes.sidecar import serve_runtime

    _setup_logging(None, "-runtime", replica=True)
    serve_runtime(
        argparse.Namespace(
            framework=framework, executable=executable, model=model, host=host, port=port,
            served_model_name=served_model_name, slots=slots, context=context,
            runtime_arg=runtime_arg or [],
        )
    )  # fmt: skip


def _push_target(url: str | None, api_key: str | None, data_dir: Path) -> tuple[str, str]:
    """The global resolution (flags, environment, profile), then the data dir's admin key."""
    from modelyard.cli_commands.profiles import ProfileError

    try:
        target = common.resolve_with(url, api_key)
    except ProfileError as exc:
        raise _fail(str(exc), 1) from exc
    if target.api_key:
        return target.url, target.api_key
    key_file = data_dir / "admin_key"
    if key_file.exists():
        return target.url, key_file.read_text().strip()
    raise _fail("no API key: pass --api-key, set MODELYARD_API_KEY, run `modelyard login`, "
                "or run next to the data dir")  # fmt: skip


@models_app.command("push")
def push(
    path: Annotated[
        Path, typer.Argument(help="A HF model folder, a .gguf file, or a PEFT LoRA folder.")
    ],
    name: Annotated[str, typer.Option(help="Registry name of the model.")],
    base: Annotated[
        str | None, typer.Option(help="For a LoRA adapter: the registry model it adapts.")
    ] = None,
    url: Annotated[
        str | None, typer.Option(help="Platform URL (default: as other commands).")
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="Admin API key.")] = None,
    data_dir: Annotated[Path, typer.Option(help="Where to find the admin key file.")] = Path(
        ".modelyard"
    ),
) -> None:
    """Upload a model as a new immutable version (only files the registry lacks are sent)."""
    from modelyard.registry_client import RegistryClient, RegistryClientError

    if not path.exists():
        raise _fail(f"{path} does not exist")
    client = RegistryClient(*_push_target(url, api_key, data_dir))
    try:
        version = client.push(path, name, base)
    except RegistryClientError as exc:
        raise _fail(str(exc)) from exc
    typer.secho(
        f"pushed {version['ref']} ({version['format']}, {version['total_size']:,} bytes)",
        fg=typer.colors.GREEN,
    )


@app.command()
def version() -> None:
    """Print the version."""
    from modelyard import __version__

    typer.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    app()
