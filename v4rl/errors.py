"""A run's failure as the one line a `v4rl` command prints: an error raised inside a Ray actor reaches the driver
wrapped (RayTaskError: the remote traceback, colour codes, then the message; RayActorError: a dead actor's story,
or, when the actor's __init__ raised, that whole remote traceback as text), so the cause is unwrapped first and
Ray's decoration dropped. An OSError of the machine's making (a full disk, a read-only place, a file that cannot
be read) that escapes any command becomes one line naming the file and the fix (OneLineErrors, the app's group).

    one_line_error(exc)   # 'writing the training checkpoint of step 4 to ... failed: OSError: [Errno 28] ...'
    os_error_line(exc)    # '/data/out.json: No space left on device; free space on that disk ...'
"""

from __future__ import annotations

import errno
import re

import typer
import typer.core

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
REMOTE_FINAL = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*): (?P<message>\S.*)$")
"""The last line of a Python traceback: `module.Type: message`, unindented."""
RUN_FAILURE_BUILTINS = ("RuntimeError", "OSError", "TimeoutError", "ValueError", "PermissionError",
                        "FileNotFoundError", "NotADirectoryError", "IsADirectoryError")
"""Builtin exception types a failed run reports by message (any other builtin is a bug)."""

OS_ERROR_FIXES = {
    errno.ENOSPC: "free space on that disk, or give a place on another one, and run again",
    errno.EDQUOT: "your disk quota is used up: free space or give a place on another disk, and run again",
    errno.EFBIG: "the file is over the size limit (ulimit -f) or the filesystem's largest file; raise the limit "
                 "or give a place on another disk",
    errno.EROFS: "the filesystem is read-only; give a place on a writable one",
    errno.EACCES: "fix its permissions or give a path you can use",
    errno.EPERM: "fix its permissions (or attributes, lsattr) or give a path you can use",
    errno.ENOENT: "check the path (a file removed while the command ran?)",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EISDIR: "it is a directory where a file belongs; check the path",
    errno.EIO: "the disk reported an I/O error; check the disk (dmesg) and run again",
}
"""OSErrors of the machine's making, with the fix each needs; any other OSError keeps its traceback."""


def root_cause(exc: BaseException) -> BaseException:
    """The exception a Ray actor raised, through any number of RayTaskError wrappers; `exc` itself otherwise."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # no Ray installed: nothing can be wrapped
        return exc
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def one_line_error(exc: BaseException) -> str:
    """The cause's message on one line (its lines joined), without colour codes; the type names a bare message."""
    cause = root_cause(exc)
    if isinstance(cause, OSError) and cause.errno in OS_ERROR_FIXES:
        return os_error_line(cause)
    raw = ANSI.sub("", str(cause))
    remote = _remote_final_line(raw) if _is_ray_error(cause) else None
    if remote is not None:  # an actor's __init__ raised: Ray kept only the text of its traceback
        return remote
    text = " ".join(line.strip() for line in raw.splitlines() if line.strip())
    if _is_ray_error(cause):  # an actor died, an object was lost: Ray's first sentence says which and why
        text = text.split(". ")[0]
    return text if text and not isinstance(cause, (OSError, KeyError)) else f"{type(cause).__name__}: {text}"


def os_error_line(exc: OSError) -> str:
    """`FILE: strerror; the fix` (the errno's fix from OS_ERROR_FIXES)."""
    fix = OS_ERROR_FIXES.get(exc.errno or 0, "check the path and the disk")
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}; {fix}"


def is_run_failure(exc: BaseException) -> bool:
    """A failure a run reports by its message (a full disk, a hung step, a dead actor, a stop, an engine's refusal):
    the library raises these with the fix in the message. Anything else is a bug, and keeps its traceback."""
    cause = root_cause(exc)
    if _is_ray_error(cause):
        remote = REMOTE_FINAL.match(_last_exception_line(ANSI.sub("", str(cause))) or "")
        return remote is None or "." in remote["type"] or remote["type"] in RUN_FAILURE_BUILTINS
    return isinstance(cause, (RuntimeError, OSError, TimeoutError, ValueError))


class OneLineErrors(typer.core.TyperGroup):
    """The app's command group: an OSError of the machine's making that escapes a command (a JSON report written
    at the end onto a disk filled meanwhile, a file unreadable deep in a checkpoint) is one line and exit 1, not a
    traceback. Commands check their paths up front (v4rl/inputs.py); this is what is left when the disk changes
    while they run. Paths are not checked for readability by typer (os.access: it answers root wrongly, and
    others in two lines of usage without the fix): each command opens what it reads itself (v4rl/inputs.py)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for command in self.commands.values():
            for param in command.params:
                info = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
                if getattr(info, "readable", False):
                    info.readable = False

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.errno not in OS_ERROR_FIXES:
                raise  # not the machine's doing: a bug, whose traceback helps
            typer.secho(f"error: {os_error_line(exc)}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1) from None


def _last_exception_line(text: str) -> str | None:
    return next((line for line in reversed(text.splitlines()) if REMOTE_FINAL.match(line)), None)


def _remote_final_line(text: str) -> str | None:
    """A remote traceback's last `module.Type: message` line as our one line: the message alone for a library
    error (they name the file and the fix), `Type: message` for a builtin. None when the text holds no traceback."""
    if "Traceback" not in text and "\n  File " not in text:
        return None
    line = _last_exception_line(text)
    if line is None:
        return None
    match = REMOTE_FINAL.match(line)
    assert match is not None
    name, message = match["type"], match["message"].strip()
    return message if "." in name else f"{name}: {message}"


def _is_ray_error(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayError
    except ImportError:
        return False
    return isinstance(exc, RayError)
