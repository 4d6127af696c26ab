"""What makes a converted checkpoint directory complete, and of which source: manifests and atomic output.

- `source_manifest(dir)`: a cheap fingerprint of a conversion source: tensor names, every file's size,
  sha256 of the small files that define it (HF: index + config.json; torch_dist: .metadata +
  common.pt), and of 16 evenly spaced 64 KiB samples of every data file (hashing 300 GB whole would
  cost as much as the conversion). Retrained weights of the same shapes change the samples; an edit
  that touches none of them is not noticed: pass `force=True` after such surgery.
- `AtomicOutput`: builds an output in a hidden sibling `.<name>.partial-<id>/` (with an OWNER file
  naming the pid) and renames it into place only on `commit()`, after writing `v4rl_conversion.json`
  (the manifest key + every output file's size). A killed run leaves only the hidden partial
  directory, which the next run for the same destination removes once its owner is dead.
- `is_complete(dst, key)`: dst was committed for exactly this source and options, and every file it
  recorded is still there with its size: re-running a conversion is then a no-op.

    with AtomicOutput(dst, force=False) as out:
        ...write into out.tmp...
        out.commit({"key": key, ...})
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

RECORD_FILE = "v4rl_conversion.json"
OWNER_FILE = "OWNER"
_HASHED_FILES = ("model.safetensors.index.json", "config.json", ".metadata", "common.pt")
_DATA_SUFFIXES = (".safetensors", ".distcp")
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 64 << 10


class OutputError(ValueError):
    """The destination is in a state a conversion must not touch (another run, a foreign directory)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sampled_sha256(path: Path, blocks: int = SAMPLE_BLOCKS, block: int = SAMPLE_BYTES) -> str:
    """sha256 of `blocks` evenly spaced `block`-byte pieces of a file (first and last included)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= blocks * block:
            h.update(f.read())
        else:
            for i in range(blocks):
                f.seek((size - block) * i // (blocks - 1))
                h.update(f.read(block))
    return h.hexdigest()


def source_manifest(src: str | Path, tensor_names: list[str]) -> dict[str, Any]:
    """Fingerprint of a source directory: tensor names, file sizes, sha256 of its index/config files, and a
    sampled sha256 of every data file (16 x 64 KiB), so re-written weights of the same shapes count as new."""
    src = Path(src)
    files = {str(p.relative_to(src)): p.stat().st_size for p in sorted(src.rglob("*"))
             if p.is_file() and p.name != RECORD_FILE and not p.name.endswith(".tmp")}
    hashed = {name: _sha256(src / name) for name in files if Path(name).name in _HASHED_FILES}
    sampled = {name: _sampled_sha256(src / name) for name in files if name.endswith(_DATA_SUFFIXES)}
    return {"tensors": sorted(tensor_names), "files": files, "sha256": hashed, "sampled_sha256": sampled}


def manifest_key(manifest: dict[str, Any], options: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a source manifest plus the options that shape the output."""
    blob = json.dumps({"source": manifest, "options": options}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def read_record(dst: str | Path) -> dict[str, Any] | None:
    """The `v4rl_conversion.json` of a committed output, or None."""
    try:
        return json.loads((Path(dst) / RECORD_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def is_complete(dst: str | Path, key: str) -> bool:
    """dst holds a committed output of exactly this key, every recorded file present with its size."""
    dst = Path(dst)
    record = read_record(dst)
    if record is None or record.get("key") != key:
        return False
    for name, size in record.get("files", {}).items():
        p = dst / name
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AtomicOutput:
    """Build a directory under a hidden temporary name; `commit()` renames it into place (see module doc)."""

    def __init__(self, dst: str | Path, *, force: bool = False, key: str | None = None) -> None:
        self.dst = Path(dst)
        self.force = force
        self.key = key
        self.tmp = self.dst.parent / f".{self.dst.name}.partial-{uuid.uuid4().hex[:8]}"
        self._committed = False

    def __enter__(self) -> AtomicOutput:
        if self.dst.exists() and not self.force:
            record = read_record(self.dst)
            if record is None:
                what = "something v4rl did not write (no completion record)"
            elif record.get("key") == self.key:
                what = "this very conversion, but files are missing or have changed size since"
            else:
                what = "a conversion of a different source or with different options"
            raise OutputError(f"{self.dst} already exists and holds {what}; choose another destination or "
                              "pass --force to replace it")
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(self.dst)
            self.tmp.mkdir()
            (self.tmp / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                           "started": time.time()}))
        except OSError as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
        return self

    def commit(self, record: dict[str, Any]) -> None:
        """Write the record (plus every file's size), fsync, and rename the temporary dir into place."""
        (self.tmp / OWNER_FILE).unlink()
        files = {str(p.relative_to(self.tmp)): p.stat().st_size for p in sorted(self.tmp.rglob("*")) if p.is_file()}
        body = dict(record, files=files, committed=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        path = self.tmp / RECORD_FILE
        with open(path, "w") as f:
            f.write(json.dumps(body, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for d in sorted({p.parent for p in self.tmp.rglob("*")} | {self.tmp}, key=lambda p: -len(p.parts)):
            fsync_dir(d)
        if self.dst.exists():  # only with force: swap, then drop the old one
            old = self.dst.parent / f".{self.dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(self.dst, old)
            os.replace(self.tmp, self.dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp, self.dst)
        fsync_dir(self.dst.parent)
        self._committed = True

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if not self._committed:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, OSError) and str(self.tmp) in str(exc):
            # a write that failed names the hidden build directory, gone now: name the output the user gave
            try:
                renamed = type(exc)(str(exc).replace(str(self.tmp), str(self.dst)))
            except Exception:  # noqa: BLE001 - a type that takes more than a message: keep it as it is
                return
            raise renamed from exc
        if isinstance(exc, OSError):  # a full disk, a read-only place: the output named, with the fix
            where = f" ({exc.filename})" if exc.filename else ""
            raise OutputError(f"writing {self.dst} failed: {exc.strerror or exc}{where}; check free space, quotas "
                              f"(ulimit -f) and permissions of {self.dst.parent}, then run again (the partial "
                              "output was removed)") from exc


def remove_stale_partials(dst: Path) -> None:
    """Delete `.<name>.partial-*` siblings left by killed runs; refuse if a live run owns one."""
    host = socket.gethostname()
    for p in dst.parent.glob(f".{dst.name}.partial-*"):
        try:
            owner = json.loads((p / OWNER_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            owner = {}
        if owner.get("host") == host and isinstance(owner.get("pid"), int) and _pid_alive(owner["pid"]):
            raise OutputError(f"another run (pid {owner['pid']}) is writing {dst} (in {p}); wait for it, or kill "
                              "it and run again")
        if owner.get("host") not in (None, host):
            raise OutputError(f"{p} belongs to a run on host {owner['host']}; if that run is dead, delete {p}")
        shutil.rmtree(p, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or new entry in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
