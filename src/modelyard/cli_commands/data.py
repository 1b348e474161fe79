"""`modelyard files …` (uploads with a progress bar over the bytes sent), `modelyard batches …`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import IO, Annotated, Any, cast

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)

from modelyard.cli_commands import common
from modelyard.cli_commands.client import ApiError, PlatformClient
from modelyard.cli_commands.output import (
    api_errors,
    console,
    details,
    field,
    print_json,
    show,
    when,
)

files_app = typer.Typer(no_args_is_help=True, help="Files (batch input and output).")
batches_app = typer.Typer(no_args_is_help=True, help="Batches (OpenAI Batch API).")
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

FINAL = frozenset({"completed", "failed", "expired", "cancelled"})


class ProgressReader:
    """A file that advances a progress bar as httpx reads it for the multipart body; `fileno`
    lets httpx size the body from the file."""

    def __init__(self, f: IO[bytes], progress: Progress, task: TaskID) -> None:
        self.f, self.progress, self.task = f, progress, task

    def read(self, size: int = -1) -> bytes:
        block = self.f.read(size)
        self.progress.advance(self.task, len(block))
        return block

    def seek(self, offset: int, whence: int = 0) -> int:
        position = self.f.seek(offset, whence)
        self.progress.update(self.task, completed=position)
        return position

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        return self.f.fileno()


def upload(c: PlatformClient, path: Path, purpose: str, quiet: bool = False) -> dict[str, Any]:
    size = path.stat().st_size
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn())  # fmt: skip
    with Progress(*columns, console=console, disable=quiet, transient=False) as progress:
        task = progress.add_task(f"uploading {path.name}", total=size)
        with open(path, "rb") as f:
            # httpx needs only read, seek, tell and fileno of a file: ProgressReader has them
            reader = cast(IO[bytes], ProgressReader(f, progress, task))
            return dict(c.upload(path, purpose, reader))


FILE_COLUMNS = [
    ("ID", field("id")),
    ("NAME", field("filename")),
    ("PURPOSE", field("purpose")),
    ("BYTES", field("bytes")),
    ("CREATED", lambda r: when(r.get("created_at"))),
]


@files_app.command("list")
def files_list(as_json: JsonFlag = False) -> None:
    """This tenant's files."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/files")["data"], FILE_COLUMNS, "Files", as_json)


@files_app.command("upload")
def files_upload(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    purpose: Annotated[str, typer.Option(help="batch (JSONL of requests).")] = "batch",
    as_json: JsonFlag = False,
) -> None:
    """Upload a file, with a progress bar."""
    with api_errors(), common.client(timeout=600.0) as c:
        created = upload(c, path, purpose, quiet=as_json)
    if as_json:
        print_json(created)
    else:
        console.print(f"uploaded [bold]{created['id']}[/bold] ({created.get('bytes'):,} bytes)")


@files_app.command("delete")
def files_delete(file_id: str, as_json: JsonFlag = False) -> None:
    """Delete a file."""
    with api_errors(), common.client() as c:
        result = c.delete(f"/v1/files/{file_id}")
    print_json(result) if as_json else console.print(f"deleted {file_id}")


def _download(c: PlatformClient, file_id: str, output: Path | None) -> None:
    if output is None:
        c.download(f"/v1/files/{file_id}/content", sys.stdout.buffer)
        sys.stdout.flush()
        return
    with open(output, "wb") as f:
        n = c.download(f"/v1/files/{file_id}/content", f)
    console.print(f"wrote {n:,} bytes to {output}", highlight=False)


Output = Annotated[Path | None, typer.Option("-o", "--output", help="File (default: stdout).")]


@files_app.command("download")
def files_download(file_id: str, output: Output = None) -> None:
    """A file's content."""
    with api_errors(), common.client(timeout=600.0) as c:
        _download(c, file_id, output)


# ----- batches --------------------------------------------------------------------------------


def _counts(b: dict[str, Any]) -> str:
    n = b.get("request_counts") or {}
    return f"{n.get('completed', 0)}+{n.get('failed', 0)} failed/{n.get('total', 0)}"


BATCH_COLUMNS = [
    ("ID", field("id")),
    ("STATUS", field("status")),
    ("ENDPOINT", field("endpoint")),
    ("DONE", _counts),
    ("INPUT", field("input_file_id")),
    ("OUTPUT", field("output_file_id")),
    ("CREATED", lambda r: when(r.get("created_at"))),
]


@batches_app.command("list")
def batches_list(as_json: JsonFlag = False) -> None:
    """This tenant's batches."""
    with api_errors(), common.client() as c:
        show(c.get("/v1/batches")["data"], BATCH_COLUMNS, "Batches", as_json)


def wait_batch(c: PlatformClient, batch_id: str, timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    with console.status("batch …") as status:
        while True:
            batch: dict[str, Any] = c.get(f"/v1/batches/{batch_id}")
            status.update(f"batch {batch_id}: {batch['status']} · {_counts(batch)}")
            if batch["status"] in FINAL:
                return batch
            if time.monotonic() - started > timeout:
                raise ApiError(0, f"batch {batch_id} still {batch['status']} after {timeout:.0f}s")
            time.sleep(0.5)


@batches_app.command("create")
def batches_create(
    input_file: Annotated[str, typer.Argument(help="A file id, or a local JSONL file to upload.")],
    endpoint: Annotated[str, typer.Option(help="The route every line calls.")] = (
        "/v1/chat/completions"
    ),
    window: Annotated[str, typer.Option(help="Completion window.")] = "24h",
    wait: Annotated[bool, typer.Option(help="Wait until it finishes.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 3600.0,
    as_json: JsonFlag = False,
) -> None:
    """Create a batch (uploading the input first when given a path)."""
    with api_errors(), common.client(timeout=600.0) as c:
        file_id = input_file
        if Path(input_file).is_file():
            file_id = upload(c, Path(input_file), "batch", quiet=as_json)["id"]
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window}
        batch = c.post("/v1/batches", body)
        if wait:
            batch = wait_batch(c, batch["id"], timeout)
    details(batch, as_json) if as_json else console.print(
        f"batch [bold]{batch['id']}[/bold]: {batch['status']} · {_counts(batch)}"
    )


@batches_app.command("show")
def batches_show(batch_id: str, as_json: JsonFlag = False) -> None:
    """One batch."""
    with api_errors(), common.client() as c:
        details(c.get(f"/v1/batches/{batch_id}"), as_json)


@batches_app.command("cancel")
def batches_cancel(batch_id: str, as_json: JsonFlag = False) -> None:
    """Cancel a batch (finished items keep their results)."""
    with api_errors(), common.client() as c:
        batch = c.post(f"/v1/batches/{batch_id}/cancel")
    print_json(batch) if as_json else console.print(f"{batch_id}: {batch['status']}")


@batches_app.command("results")
def batches_results(
    batch_id: str,
    output: Output = None,
    errors: Annotated[bool, typer.Option("--errors", help="The error file instead.")] = False,
    wait: Annotated[bool, typer.Option(help="Wait until the batch finishes.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 3600.0,
) -> None:
    """A batch's output JSONL (or its errors with --errors)."""
    with api_errors(), common.client(timeout=600.0) as c:
        batch = wait_batch(c, batch_id, timeout) if wait else c.get(f"/v1/batches/{batch_id}")
        file_id = batch.get("error_file_id" if errors else "output_file_id")
        if not file_id:
            what = "errors" if errors else "output"
            raise ApiError(0, f"batch {batch_id} ({batch['status']}) has no {what} file yet")
        _download(c, file_id, output)
