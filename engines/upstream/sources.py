"""The real engines' pinned versions, and their sources on a CPU machine (for conformance checks and preflight).

v4rl drives SGLang, Miles and Megatron-LM on clusters; what it hands them is checked by running their OWN code
on CPU in a subprocess (never imported by v4rl's library code, never copied into the repo):

  - SGLang: the version pinned by pyproject.toml's `cluster` extra (one edit bumps the launcher, the
    conformance suite and this cache together). Its wheel comes from the package registry and is unpacked,
    with the pure-Python packages its modules import that v4rl's environment lacks, into a cache outside the
    repo (`$V4RL_ENGINE_CACHE`, default `~/.cache/v4rl/engines`); installed once, reused offline.
    `$V4RL_SGLANG_DIR` points at another SGLang source tree (a directory holding `sglang/`) instead.
  - Miles and Megatron-LM: a user's checkout (`explicit` argument, `$V4RL_MILES_DIR` / `$V4RL_MEGATRON_DIR`),
    else the pinned tarball of `../shared/vendor/` (`$V4RL_VENDOR_DIR`) extracted into the same cache.

`engine_python` runs code in a subprocess with those trees on `sys.path` and the GPU-only imports stubbed
(engines/upstream/stubs.py). Everything that is missing raises `EngineSourceMissing` saying what to set.
`engine_error` turns a failed run's output into the engine's own last error lines (argparse's `prog: error: ...`,
the assertion or exception text), one line, never a traceback: what every probe's caller reports.

    from engines.upstream.sources import engine_python, miles_tree, sglang_paths
    done = engine_python("import sglang.srt.server_args as s; print(s.ServerArgs.__name__)", sglang_paths())
    print(done.stdout)        # ServerArgs
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from engines.miles.pins import MEGATRON, MILES, SourcePin
from engines.rollout.sglang_pin import SGLangPinMissing, sglang_version

REPO = Path(__file__).resolve().parents[2]


class EngineSourceMissing(RuntimeError):
    """An engine's source is not available here; the message says which variable or step provides it."""


def _sglang_version() -> str:
    """The pinned SGLang version (engines/rollout/sglang_pin.py), its absence an EngineSourceMissing."""
    try:
        return sglang_version()
    except SGLangPinMissing as exc:
        raise EngineSourceMissing(str(exc)) from None


# Packages SGLang's server, request structs, configs, DeepSeek-V4 model module, clients and test helpers import
# at module level that v4rl's own environment does not have (found by importing them on CPU), plus what Miles'
# argument parser imports (sglang-router, polars). Installed without their dependencies; versions are SGLang's
# own pins where its wheel has one, else these.
SGLANG_CPU_DEPS: dict[str, str] = {
    "pybase64": "1.5.1", "msgspec": "0.23.0", "pyzmq": "27.3.0", "ipython": "9.18.1", "traitlets": "5.16.1",
    "uvloop": "0.23.0", "apache-tvm-ffi": "", "sentencepiece": "", "compressed-tensors": "", "loguru": "0.7.3",
    "gguf": "0.19.0", "openai": "", "einops": "0.8.2", "partial-json-parser": "0.2.1.1.post7",
    "setproctitle": "1.3.8", "xgrammar": "", "soundfile": "", "python-multipart": "0.0.34",
    "sglang-router": "0.3.2", "polars": "2.1.0",
    # sglang.test.send_one (SGLang's own one-prompt client, run by the conformance suite against v4rl's server)
    "tabulate": "0.9.0",
}


# ------------------------------------------------------------------------------------------------ pins
def cache_root() -> Path:
    """Where extracted and installed engine sources live ($V4RL_ENGINE_CACHE, default ~/.cache/v4rl/engines)."""
    return Path(os.environ.get("V4RL_ENGINE_CACHE") or Path.home() / ".cache" / "v4rl" / "engines").expanduser()


def vendor_dir() -> Path | None:
    """The pinned tarballs: $V4RL_VENDOR_DIR, else ../shared/vendor beside the repository; None if neither."""
    given = os.environ.get("V4RL_VENDOR_DIR")
    path = Path(given).expanduser() if given else REPO.parent / "shared" / "vendor"
    return path if path.is_dir() else None


# ----------------------------------------------------------------------------------------- Miles/Megatron
def miles_tree(explicit: str | Path | None = None, pin: SourcePin = MILES) -> Path:
    """A Miles checkout: `explicit`, else $V4RL_MILES_DIR, else the pin's vendor tarball (extracted once)."""
    return _source_tree(pin, explicit, marker="miles/utils/arguments.py")


def megatron_tree(explicit: str | Path | None = None, pin: SourcePin = MEGATRON) -> Path:
    """A Megatron-LM checkout: `explicit`, else $V4RL_MEGATRON_DIR, else the pin's vendor tarball."""
    return _source_tree(pin, explicit, marker="megatron/training/arguments.py")


def _source_tree(pin: SourcePin, explicit: str | Path | None, *, marker: str) -> Path:
    given = explicit or os.environ.get(pin.env)
    if given:
        path = Path(given).expanduser().resolve()
        if not (path / marker).is_file():
            where = "the given directory" if explicit else f"${pin.env}"
            raise EngineSourceMissing(f"{where} {path} is not a {pin.name} checkout (no {marker}); point it at the "
                                      f"repository root of {pin.repo}")
        return path
    vendor = vendor_dir()
    tarball = vendor / pin.tarball if vendor else None
    if tarball is None or not tarball.is_file():
        raise EngineSourceMissing(f"no {pin.name} source: set ${pin.env} to a checkout of {pin.repo} at {pin.short} "
                                  f"(or $V4RL_VENDOR_DIR to a directory holding {pin.tarball})")
    dest = cache_root() / f"{pin.name}-{pin.short}"
    if not (dest / marker).is_file():
        with _locked(dest):
            if not (dest / marker).is_file():
                _extract(tarball, dest)
    return dest


def _extract(tarball: Path, dest: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        tops = [p for p in tmp.iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise EngineSourceMissing(f"{tarball}: expected one top-level directory, found {[p.name for p in tops]}")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tops[0], dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- SGLang
def sglang_paths(install: bool = True) -> list[Path]:
    """sys.path entries that make the pinned SGLang importable on CPU (with engine_stubs active).

    $V4RL_SGLANG_DIR (a directory holding `sglang/`) wins; its dependencies must then be importable already.
    Otherwise the cache for this SGLang version and Python; `install` fetches it from the registry once.
    """
    given = os.environ.get("V4RL_SGLANG_DIR")
    if given:
        path = Path(given).expanduser().resolve()
        if not (path / "sglang" / "srt" / "server_args.py").is_file():
            raise EngineSourceMissing(f"$V4RL_SGLANG_DIR {path} holds no sglang/srt/server_args.py; point it at the "
                                      "directory that contains the `sglang` package (SGLang's python/ folder)")
        return [path]
    version = _sglang_version()
    home = cache_root() / f"sglang-{version}-py{sys.version_info.major}{sys.version_info.minor}"
    _build_once(home, lambda: _install_sglang(version, home), install=install,
                missing=f"SGLang {version} is not in {home}; run once with network access "
                        "(engines.upstream.sources.sglang_paths()) or set $V4RL_SGLANG_DIR")
    if _missing_deps(home):  # SGLANG_CPU_DEPS grew since this cache was built
        if not install:
            raise EngineSourceMissing(f"the SGLang {version} cache in {home} lacks {', '.join(_missing_deps(home))}; "
                                      "run once with network access (engines.upstream.sources.sglang_paths())")
        with _locked(home):
            if _missing_deps(home):
                _top_up_deps(home)
    return [home / "src", home / "deps"]


def _build_once(home: Path, build, *, install: bool, missing: str) -> None:
    """Run `build` (which leaves home/ready.json) unless it already ran; once across processes (a lock)."""
    if (home / "ready.json").is_file():
        return
    if not install:
        raise EngineSourceMissing(missing)
    with _locked(home):
        if not (home / "ready.json").is_file():
            build()


def _missing_deps(home: Path) -> list[str]:
    """Packages of SGLANG_CPU_DEPS the cache was installed without (the list grew since)."""
    try:
        installed = {_norm(re.split(r"==", d)[0]) for d in json.loads((home / "ready.json").read_text())["deps"]}
    except (OSError, ValueError, KeyError):
        return list(SGLANG_CPU_DEPS)
    return [name for name in SGLANG_CPU_DEPS if _norm(name) not in installed]


def _top_up_deps(home: Path) -> None:
    """Install the packages added to SGLANG_CPU_DEPS since the cache was built, then record them."""
    record = json.loads((home / "ready.json").read_text())
    specs = _dep_specs(_missing_deps(home), _wheel_pins((home / "METADATA").read_text())
                       if (home / "METADATA").is_file() else {})
    _pip("install", "--no-deps", "--target", str(home / "deps"), *specs)
    record["deps"] = list(record["deps"]) + specs
    tmp = home / "ready.json.partial"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, home / "ready.json")


def _dep_specs(names: Sequence[str], pins: Mapping[str, str]) -> list[str]:
    """`name==version` per package: SGLang's own pin where its wheel has one, else ours, else unpinned."""
    specs = []
    for name in names:
        version = pins.get(_norm(name)) or SGLANG_CPU_DEPS[name]
        specs.append(f"{name}=={version}" if version else name)
    return specs


def _install_sglang(version: str, home: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{home.name}.", dir=home.parent))
    try:
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(tmp / "wheel"), f"sglang=={version}")
        wheel = next((tmp / "wheel").glob("sglang-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp / "src")
            meta = zf.read(f"sglang-{version}.dist-info/METADATA").decode()
        (tmp / "METADATA").write_text(meta)  # kept: a later top-up of the dependency list reads its pins
        specs = _dep_specs(list(SGLANG_CPU_DEPS), _wheel_pins(meta))
        _pip("install", "--no-deps", "--target", str(tmp / "deps"), *specs)
        (tmp / "ready.json").write_text(json.dumps({"sglang": version, "deps": specs}, indent=1) + "\n")
        shutil.rmtree(tmp / "wheel")
        shutil.rmtree(home, ignore_errors=True)
        os.replace(tmp, home)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------------------------- Miles' launchers
LAUNCHER_CLI: tuple[str, ...] = ("typer==0.25.1", "click==8.2.1")
"""The CLI libraries Miles' docker/Dockerfile.rocm pins; its typer launchers are recorded with exactly these
(v4rl's own environment may hold newer ones, so they live in a cache, never in the venv)."""


def launcher_cli_paths(install: bool = True) -> list[Path]:
    """sys.path entries (first) holding LAUNCHER_CLI, cached for this Python; installed from the registry once."""
    home = cache_root() / ("launcher-cli-" + "-".join(s.replace("==", "") for s in LAUNCHER_CLI)
                           + f"-py{sys.version_info.major}{sys.version_info.minor}")

    def build() -> None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{home.name}.", dir=home.parent))
        try:
            _pip("install", "--no-deps", "--target", str(tmp), *LAUNCHER_CLI)
            (tmp / "ready.json").write_text(json.dumps(list(LAUNCHER_CLI)) + "\n")
            shutil.rmtree(home, ignore_errors=True)
            os.replace(tmp, home)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    _build_once(home, build, install=install,
                missing=f"{' '.join(LAUNCHER_CLI)} are not in {home}; run once with access to the package registry "
                        "(engines.upstream.sources.launcher_cli_paths())")
    return [home]


def _wheel_pins(metadata: str) -> dict[str, str]:
    """`name==version` pins of a wheel's unconditional Requires-Dist lines, by normalised name."""
    pins = {}
    for line in metadata.splitlines():
        m = re.match(r"Requires-Dist: ([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;,]+)\s*$", line)
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        raise EngineSourceMissing(f"`{' '.join(cmd[2:])}` took over 900 s; check the package registry") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise EngineSourceMissing(f"`pip {' '.join(args)}` failed (offline? registry unreachable?):\n{tail}\n"
                                  "run once with access to the package registry, or set $V4RL_SGLANG_DIR")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside `path`: concurrent test workers and preflights install or extract only once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------ running code
_BOOTSTRAP = """\
import importlib.util, json, os, sys
sys.path[:0] = json.loads(os.environ["V4RL_ENGINE_PATHS"])
spec = importlib.util.spec_from_file_location("engine_stubs", os.environ["V4RL_ENGINE_STUBS"])
stubs = importlib.util.module_from_spec(spec); sys.modules["engine_stubs"] = stubs; spec.loader.exec_module(stubs)
roots = json.loads(os.environ["V4RL_STUB_ROOTS"])
stubs.activate(roots if roots is not None else stubs.GPU_ONLY_ROOTS)
"""


def engine_command(code: str, paths: Sequence[str | Path], *, args: Sequence[str] = (),
                   stub_roots: Sequence[str] | None = None, env: Mapping[str, str] | None = None
                   ) -> tuple[list[str], dict[str, str]]:
    """The argv and environment `engine_python` runs, for a caller that needs a long-lived process (Popen):
    `code` as `python -c` with `paths` first on sys.path and the GPU-only stubs active."""
    child_env = {**os.environ, **(env or {}), "V4RL_ENGINE_PATHS": json.dumps([str(p) for p in paths]),
                 "V4RL_ENGINE_STUBS": str(Path(__file__).with_name("stubs.py")),
                 "V4RL_STUB_ROOTS": json.dumps(list(stub_roots) if stub_roots is not None else None)}
    return [sys.executable, "-c", _BOOTSTRAP + code, *args], child_env


def engine_python(code: str, paths: Sequence[str | Path], *, args: Sequence[str] = (),
                  stub_roots: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                  cwd: str | Path | None = None, timeout: float = 600.0, check: bool = True
                  ) -> subprocess.CompletedProcess:
    """Run `code` (as `python -c`, `args` in sys.argv[1:]) with `paths` first on sys.path and GPU-only imports
    stubbed (`stub_roots`, default engine_stubs.GPU_ONLY_ROOTS; `sys.modules["engine_stubs"]` lists what was
    stubbed). The child gets this interpreter and `env` on top of ours. `check` raises RuntimeError with the
    output's tail when it exits non-zero; a run past `timeout` raises TimeoutError naming it."""
    cmd, child_env = engine_command(code, paths, args=args, stub_roots=stub_roots, env=env)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=child_env, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"engine code did not finish within {timeout:.0f}s (paths {list(map(str, paths))})") from exc
    if check and done.returncode != 0:
        raise RuntimeError(f"engine code exited with {done.returncode}: {engine_error(done.stderr, done.stdout)}")
    return done


_ERROR_LINE = re.compile(r"^(?:[\w.\-]+: error: \S.*"  # argparse: `train.py: error: unrecognized arguments: ...`
                         r"|Error: \S.*"  # click/typer: `Error: No such option: --x`
                         r"|(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Rejected)(?::.*)?)$")
"""A line an engine ends with when it fails: argparse's and click's error line, or an exception line (the last line
of a traceback, `AssertionError: TP must divide ...`); frames and source lines are indented and never match."""
ERROR_LINES = 3
ERROR_CHARS = 800


def engine_error_lines(*texts: str | None, limit: int = ERROR_LINES) -> list[str]:
    """The last `limit` distinct error lines of an engine's output (stderr, stdout, a caught exception's text)."""
    found: list[str] = []
    for text in texts:
        for line in (text or "").splitlines():
            line = line.rstrip()
            if _ERROR_LINE.match(line) and line not in ("SystemExit", "SystemExit: 0"):
                if line in found:
                    found.remove(line)
                found.append(line)
    return found[-limit:]


def engine_error(*outputs: str | None, exception: str | None = None,
                 fallback: str = "it printed no error line") -> str:
    """One line for a user: the engine's last error lines in `outputs` (a subprocess's stderr, stdout; with none,
    their last non-empty line) and then `exception` (what a probe caught, kept whole), joined by '; '.
    `SystemExit: 2` after argparse's own message is dropped (it says nothing more)."""
    lines = engine_error_lines(*outputs)
    if not lines:
        last = [x.strip() for t in outputs for x in (t or "").splitlines() if x.strip()]
        lines = last[-1:]
    if exception and exception.strip():
        caught = " ".join(exception.split())
        lines = [x for x in lines if x != caught and not caught.startswith(x)][-(ERROR_LINES - 1):] + [caught]
    lines = lines[-ERROR_LINES:]
    if len(lines) > 1:
        lines = [x for x in lines if not x.startswith("SystemExit")] or lines
    text = "; ".join(lines) or fallback
    return text if len(text) <= ERROR_CHARS else "..." + text[-ERROR_CHARS:]
