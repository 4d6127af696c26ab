"""Refusing unknown fields of a typed setting, naming each one and the closest valid name: a setting built from a
dict (a Prefect parameter, JSON, a Ray actor's arguments) would otherwise drop a misspelt key (`stepz`) or fail
with Python's "unexpected keyword argument", and a typo would start the default run.

    >>> check_known_fields({"stepz": 3}, ("steps", "lr"), "params")
    Traceback (most recent call last):
    ValueError: params: unknown field 'stepz'; did you mean 'steps'?

flows/params.py and flows/nightly.py use it from their pydantic models; the dataclasses built from dicts
(rl/correction_setting.py, engines/presets/runs.py overrides, engines/train/run.py TrainRunConfig.from_dict) call
it before construction.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["check_known_fields", "unknown_fields_message"]


def unknown_fields_message(given: Iterable[str], known: Iterable[str], what: str) -> str | None:
    """One line naming every key of `given` not in `known`, each with its closest known name (difflib), or None
    when all are known. Without a close name the line lists the known ones. `what` (e.g. "rollout_correction")
    starts the line; empty where the caller names the setting already (Prefect names the flow parameter)."""
    known = sorted(set(known))
    prefix = f"{what}: " if what else ""
    unknown = sorted(set(map(str, given)) - set(known))
    if not unknown:
        return None
    hints = {}
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        close = close or difflib.get_close_matches(name.lower().replace("-", "_"), known, n=1, cutoff=0.6)
        hints[name] = close[0] if close else None
    listed = "" if all(hints.values()) else f" (known: {', '.join(known)})"
    if len(unknown) == 1:
        name, hint = next(iter(hints.items()))
        return f"{prefix}unknown field {name!r}" + (f"; did you mean {hint!r}?" if hint else listed)
    parts = [f"{name!r}" + (f" (did you mean {hint!r}?)" if hint else "") for name, hint in hints.items()]
    return f"{prefix}unknown fields {', '.join(parts)}{listed}"


def check_known_fields(given: Iterable[str], known: Iterable[str], what: str) -> None:
    """ValueError with unknown_fields_message when `given` holds a key not in `known`."""
    message = unknown_fields_message(given, known, what)
    if message:
        raise ValueError(message)
