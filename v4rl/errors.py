"""A run's failure as the one line a `v4rl` command prints: an error raised inside a Ray actor reaches the driver
wrapped (RayTaskError: the remote traceback, colour codes, then the message; RayActorError: a dead actor's story),
so the cause is unwrapped first and Ray's decoration dropped.

    one_line_error(exc)   # 'writing the training checkpoint of step 4 to ... failed: OSError: [Errno 28] ...'
"""

from __future__ import annotations

import re

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


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
    text = " ".join(line.strip() for line in ANSI.sub("", str(cause)).splitlines() if line.strip())
    if _is_ray_error(cause):  # an actor died, an object was lost: Ray's first sentence says which and why
        text = text.split(". ")[0]
    return text if text and not isinstance(cause, (OSError, KeyError)) else f"{type(cause).__name__}: {text}"


def is_run_failure(exc: BaseException) -> bool:
    """A failure a run reports by its message (a full disk, a hung step, a dead actor, a stop, an engine's refusal):
    the library raises these with the fix in the message. Anything else is a bug, and keeps its traceback."""
    cause = root_cause(exc)
    return isinstance(cause, (RuntimeError, OSError, TimeoutError, ValueError)) or _is_ray_error(cause)


def _is_ray_error(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayError
    except ImportError:
        return False
    return isinstance(exc, RayError)
