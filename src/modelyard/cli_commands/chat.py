"""`modelyard chat MODEL [PROMPT]`: a streamed answer on the terminal, or a REPL without PROMPT;
`modelyard models served`: the models the key can call, with their kind (`GET /v1/models`)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from modelyard.cli_commands import common
from modelyard.cli_commands.client import ApiError, PlatformClient
from modelyard.cli_commands.output import api_errors, errors, field, safe, show

KINDS = ("chat", "completion", "embedding", "classifier")
SERVED_COLUMNS = [
    ("MODEL", field("id")),
    ("KIND", lambda m: m.get("kind") or "provisioning"),
    ("CONTEXT", lambda m: (m.get("capabilities") or {}).get("max_context") or "-"),
    ("CAN", lambda m: ", ".join(k for k, v in (m.get("capabilities") or {}).items() if v is True)),
    ("OWNER", field("owned_by")),
]


def models_served(
    kind: Annotated[
        str | None, typer.Option(help=f"Only models of this kind ({', '.join(KINDS)}).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """The models this key can call, with their kind (which routes they answer), context length
    and capabilities."""
    if kind is not None and kind not in KINDS:
        raise typer.BadParameter(f"--kind must be one of {', '.join(KINDS)}")
    with api_errors(), common.client() as c:
        models = [m for m in c.get("/v1/models")["data"] if kind is None or m.get("kind") == kind]
    show(models, SERVED_COLUMNS, "Models served", as_json)


def stream_answer(c: PlatformClient, body: dict[str, Any]) -> str:
    """Print each token as it arrives; the whole answer."""
    parts: list[str] = []
    for chunk in c.stream_chat(body):
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                parts.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def chat(
    model: Annotated[str, typer.Argument(help="A chat model (`modelyard models served`).")],
    prompt: Annotated[str | None, typer.Argument(help="One message; without it, a REPL.")] = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
    temperature: Annotated[float | None, typer.Option("-t", "--temperature")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Most tokens per answer.")] = None,
) -> None:
    """Chat with a model; tokens stream to the terminal as they are generated."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    def body() -> dict[str, Any]:
        b: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
        if temperature is not None:
            b["temperature"] = temperature
        if max_tokens is not None:
            b["max_tokens"] = max_tokens
        return b

    with api_errors(), common.client(timeout=600.0) as c:
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
            stream_answer(c, body())
            return
        errors.print(f"chatting with {model}; an empty line or Ctrl-D ends", highlight=False)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            try:
                answer = stream_answer(c, body())
            except ApiError as exc:  # one refused turn does not end the session
                messages.pop()
                errors.print(f"[red]error:[/red] {safe(str(exc))}", highlight=False)
                continue
            messages.append({"role": "assistant", "content": answer})
