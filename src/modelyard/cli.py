"""`modelyard …`: the command line (typer). Errors are one clear line, not a traceback."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from modelyard.config import EngineSettings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="modelyard inference platform")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


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
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Serve one model over the OpenAI API (chat, completions, models, health, metrics)."""
    from modelyard.engine.models.config import UnsupportedModelError
    from modelyard.engine.models.loader import ModelNotFoundError
    from modelyard.worker.server import serve_worker

    _setup_logging(log_level)
    overrides: dict[str, object] = {}
    if dtype:
        overrides["dtype"] = dtype
    if kv_cache_memory:
        overrides["kv_cache_memory"] = kv_cache_memory
    try:
        settings = EngineSettings(**overrides)  # type: ignore[arg-type]
        serve_worker(model, host, port, settings, served_model_name, log_level)
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


@app.command()
def version() -> None:
    """Print the version."""
    from modelyard import __version__

    typer.echo(__version__)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
