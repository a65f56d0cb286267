"""Old import paths of modules that moved into sub-packages keep working, as the same module.

``kvbench.loadgen`` and ``kvbench.reports`` were flat folders; their modules now sit in
sub-packages that show their parts. A user's locustfile or script importing an old path
(``from kvbench.loadgen.client import StreamingClient``) gets the module at its new home, the
very same module object (not a copy re-exporting names), so a patch applied through either path
is seen through both. A package lists its moves with ``keep_old_paths``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.moves: dict[str, str] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moves:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(self.moves[spec.name])

    def exec_module(self, module) -> None:
        """Nothing to run: the module ran once, at its new home."""


_FINDER = _OldPaths()


def keep_old_paths(package: str, moves: dict[str, str]) -> None:
    """Make ``<package>.<old>`` import as ``<package>.<new>`` for each ``old: new`` of
    ``moves`` (module names relative to ``package``)."""
    _FINDER.moves.update({f"{package}.{old}": f"{package}.{new}" for old, new in moves.items()})
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
