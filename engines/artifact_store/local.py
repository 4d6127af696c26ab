"""The file:// store: objects are files under a root directory, written to a temporary name and renamed, so
a reader never sees half an object. There is no metadata store; the stored sha256 is the file's own hash."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

from engines.artifact_store.common import ArtifactStoreError, TransientStoreError
from engines.artifact_store.paths import check_key

CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class FileBackend:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.retries = 0  # nothing to retry on a local disk

    def __repr__(self) -> str:
        return f"FileBackend({self.root.as_uri()})"

    def _path(self, key: str) -> Path:
        path = self.root.joinpath(*check_key(key).split("/"))
        # A symlink planted inside the store must not redirect a write outside it.
        real_root = self.root.resolve()
        real = path.resolve()
        if real != real_root and real_root not in real.parents:
            raise ValueError(f"store key {key!r} resolves to {real}, outside the store root {real_root}")
        return path

    def url(self, key: str) -> str:
        return self._path(key).as_uri()

    def list(self, prefix: str) -> dict[str, int]:
        base = self._path(prefix) if prefix else self.root
        out: dict[str, int] = {}
        if not base.is_dir():
            return out
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            for name in filenames:
                if name.startswith(".") and name.endswith(".part"):
                    continue  # a write in flight
                p = Path(dirpath, name)
                if p.is_file() and not p.is_symlink():
                    out[p.relative_to(self.root).as_posix()] = p.stat().st_size
        return dict(sorted(out.items()))

    def stored_sha256(self, key: str) -> str | None:
        path = self._path(key)
        return sha256_file(path) if path.is_file() else None

    def _write(self, key: str, write) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        self._write(key, lambda f: f.write(data))

    def put_file(self, key: str, path: Path, sha256: str, size: int) -> None:
        def copy(f):
            h = hashlib.sha256()
            with open(path, "rb") as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    f.write(chunk)
            if h.hexdigest() != sha256:
                raise TransientStoreError(f"{path} changed while it was copied to {self.url(key)}; "
                                          "upload again once the writer has finished")
        self._write(key, copy)

    def probe(self, key: str, data: bytes) -> str | None:
        """Write `data` at `key` and remove it with the directories the write created: ArtifactStoreError naming
        the path and the fix when the directory cannot be created or written."""
        dest = self._path(key)
        missing = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]
        try:
            self._write(key, lambda f: f.write(data))
            dest.unlink()
        except OSError as exc:
            raise ArtifactStoreError(f"cannot write in {dest.parent}: {exc.strerror or exc}; give store_url a "
                                     "directory this user can create and write, or leave it empty for "
                                     "<runs_root>/store") from None
        for directory in missing:  # deepest first: the store's tree is as it was
            try:
                directory.rmdir()
            except OSError:  # something else wrote there meanwhile: it stays
                break
        return None

    def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"no object {self.url(key)}")
        if max_bytes is not None and path.stat().st_size > max_bytes:
            raise ValueError(f"{self.url(key)} is {path.stat().st_size} bytes, over the {max_bytes}-byte limit")
        return path.read_bytes()

    def get_file(self, key: str, dest: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise FileNotFoundError(f"no object {self.url(key)}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def close(self, *, cancel: bool = False) -> None:
        pass
