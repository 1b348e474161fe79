"""This node's cache of model files: the first cold-start layer.

The artifact store is the registry's source of truth (local disk by default, an S3 bucket in a
cluster: `store.artifact_store.BlobStore`); a worker loads from this node's own copy. On a miss a
version's blobs are copied out of the store, whichever it is, through one code path: each one
hashed while it is copied and checked against its sha256 (so nothing corrupted, on disk or in
the bucket, is ever loaded), into a folder renamed into place once complete. Hits only touch the
folder. The cache is capped in bytes and evicts the least recently used versions that no replica
is using, together with what the engine derived from them (converted GGUF weights).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from modelyard.control.registry import ResolvedVersion
from modelyard.store.artifact_store import BlobStore
from modelyard.store.artifacts import IntegrityError, check_relative_path

log = logging.getLogger(__name__)

_MARKER = ".complete.json"
_CHUNK = 1 << 22


@dataclass(frozen=True)
class CacheEntry:
    version_id: str
    path: Path  # the folder, or the GGUF file in it
    size: int
    hit: bool


class NodeCache:
    def __init__(self, root: Path, store: BlobStore, max_bytes: int) -> None:
        self.root = root
        self.store = store
        self.max_bytes = max_bytes
        self.versions = root / "versions"
        self.engine_cache = root / "engine"  # MODELYARD_CACHE_DIR of the workers on this node
        self.hits = 0
        self.misses = 0
        for d in (self.versions, self.engine_cache):
            d.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _entry_path(folder: Path, version: ResolvedVersion) -> Path:
        if version.format == "gguf":
            return folder / next(p for p in version.files if p.endswith(".gguf"))
        return folder

    def fetch(self, version: ResolvedVersion, in_use: set[str] | None = None) -> CacheEntry:
        """The version's files on this node, copied and verified on first use."""
        folder = self.versions / version.version_id
        marker = folder / _MARKER
        if marker.exists():
            os.utime(marker)  # last use, for LRU
            self.hits += 1
            return CacheEntry(version.version_id, self._entry_path(folder, version),
                              version.total_size, True)  # fmt: skip
        self.misses += 1
        self.evict_for(version.total_size, in_use or set())
        build = Path(tempfile.mkdtemp(dir=self.versions, prefix=".fetch-"))
        try:
            for rel, sha in version.files.items():
                dest = build / check_relative_path(rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                self._copy_verified(sha, dest)
            (build / _MARKER).write_text(json.dumps({"files": version.files, "at": time.time()}))
            try:
                os.rename(build, folder)
            except OSError:
                if not (folder / _MARKER).exists():
                    raise
        finally:
            shutil.rmtree(build, ignore_errors=True)
        return CacheEntry(version.version_id, self._entry_path(folder, version),
                          version.total_size, False)  # fmt: skip

    def _copy_verified(self, sha256: str, dest: Path) -> None:
        digest = hashlib.sha256()
        with closing(self.store.open(sha256)) as src, open(dest, "wb") as out:
            while block := src.read(_CHUNK):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != sha256:
            raise IntegrityError(
                f"blob {sha256} is corrupted in the store (it hashes to {digest.hexdigest()})"
            )
        os.chmod(dest, 0o400)

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, folder) of every complete version."""
        out = []
        for folder in self.versions.iterdir():
            marker = folder / _MARKER
            if folder.name.startswith(".") or not marker.exists():
                continue
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            out.append((marker.stat().st_mtime, size, folder))
        return out

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def evict_for(self, incoming: int, in_use: set[str]) -> None:
        """Make room for `incoming` bytes, oldest unused versions first."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, folder in entries:
            if total + incoming <= self.max_bytes:
                return
            if folder.name in in_use:
                continue
            self.evict(folder.name)
            total -= size

    def evict(self, version_id: str) -> None:
        folder = self.versions / version_id
        marker = folder / _MARKER
        if marker.exists():
            files = json.loads(marker.read_text()).get("files", {})
            for rel, sha in files.items():
                if rel.endswith(".gguf"):  # the engine's conversion of it goes too
                    shutil.rmtree(self.engine_cache / "converted" / sha, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        log.info("node cache: evicted %s", version_id)
