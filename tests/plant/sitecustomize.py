"""Plants a fault in a child process the tests start (tests/planted.py `plant_in_children`), at start-up.

Python imports `sitecustomize` from sys.path when the interpreter starts, so with tests/plant on PYTHONPATH every
child and every Ray worker it starts runs this. With V4RL_TESTS_PLANT unset it does nothing; set, it waits for the
module the fault goes into to be imported and patches it there (importing it here would load torch into every
Python process of the run, Ray's own included).
"""

import importlib.abc
import os
import sys

TARGET = "engines.runs.checkpointing"


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds TARGET through the other finders and runs the plant once the module has executed."""

    def __init__(self, spec_text: str) -> None:
        self.spec_text, self.loader = spec_text, None

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            find = None if finder is self else getattr(finder, "find_spec", None)
            found = find(name, path, target) if find else None
            if found is not None:
                self.loader, found.loader = found.loader, self
                return found
        return None

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        from tests.planted import apply_child_plant

        apply_child_plant(self.spec_text, module)

    def __getattr__(self, name):  # the rest of the loader protocol (get_source, is_package, ...) as found
        return getattr(self.loader, name)


if os.environ.get("V4RL_TESTS_PLANT"):
    sys.meta_path.insert(0, _PatchAfterImport(os.environ["V4RL_TESTS_PLANT"]))
