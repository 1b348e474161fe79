"""Client side of the registry upload protocol, with progress bars (used by `models push`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from modelyard.cli_commands.client import error_from
from modelyard.store.artifacts import scan_folder

_CHUNK = 1 << 20


class RegistryClientError(RuntimeError):
    pass


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


class RegistryClient:
    def __init__(self, url: str, api_key: str, timeout: float = 600.0) -> None:
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )

    def _check(self, response: httpx.Response) -> dict[str, Any]:
        if response.status_code >= 400:
            raise RegistryClientError(str(error_from(response)))
        return response.json() if response.content else {}

    def push(self, path: Path, name: str, base: str | None = None) -> dict[str, Any]:
        """Upload the folder's missing blobs and create a version (`base`: the registry model a
        PEFT LoRA adapter folder was trained on)."""
        files = list(scan_folder(path))
        if not files:
            raise RegistryClientError(f"{path} holds no files")
        total = sum(f.stat().st_size for _, f in files)
        manifest: dict[str, dict[str, Any]] = {}
        try:
            with _progress() as progress:
                hashing = progress.add_task("hashing", total=total)
                for rel, file in files:
                    manifest[rel] = {"sha256": self._hash(file, progress, hashing),
                                     "size": file.stat().st_size}  # fmt: skip
                missing = [
                    (rel, file)
                    for rel, file in files
                    if self.http.head(f"/v1/blobs/{manifest[rel]['sha256']}").status_code != 200
                ]
                upload_bytes = sum(f.stat().st_size for _, f in missing)
                uploading = progress.add_task(
                    f"uploading {len(missing)} of {len(files)} files", total=upload_bytes
                )
                for rel, file in missing:
                    sha = manifest[rel]["sha256"]
                    body = self._stream(file, progress, uploading)
                    self._check(self.http.put(f"/v1/blobs/{sha}", content=body))
            return self._check(
                self.http.post(
                    f"/v1/registry/models/{quote(name, safe='')}/versions",
                    json={"files": manifest, **({"base_model": base} if base else {})},
                )
            )
        except httpx.HTTPError as exc:
            raise RegistryClientError(f"cannot reach {self.http.base_url}: {exc}") from exc

    @staticmethod
    def _hash(file: Path, progress: Progress, task: TaskID) -> str:
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while block := f.read(_CHUNK):
                digest.update(block)
                progress.advance(task, len(block))
        return digest.hexdigest()

    @staticmethod
    def _stream(file: Path, progress: Progress, task: TaskID) -> Iterator[bytes]:
        with open(file, "rb") as f:
            while block := f.read(_CHUNK):
                progress.advance(task, len(block))
                yield block
