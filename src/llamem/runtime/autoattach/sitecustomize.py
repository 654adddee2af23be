"""Put first on PYTHONPATH by `llamem monitor`: runs the sitecustomize this one hides, then
attaches llamem's memory monitor to every transformers Trainer once `transformers.trainer` is
imported. llamem itself is imported only then, not at every interpreter start (the training
script's own subprocesses inherit PYTHONPATH too)."""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGET = "transformers.trainer"


def _run_hidden_sitecustomize() -> None:
    """The sitecustomize later on sys.path (a distribution's, a venv's) still runs."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


class _TrainerFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands `transformers.trainer` to the other finders and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        try:
            if importlib.util.find_spec("llamem") is None:  # a child run by another interpreter
                sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
            from llamem.runtime.autoattach import patch_trainer

            patch_trainer(module.Trainer)
        except Exception as err:  # the training run matters more than its monitor
            print(f"llamem monitor: not attached ({type(err).__name__}: {err})", file=sys.stderr)

    def __getattr__(self, name):
        return getattr(self.loader, name)


try:
    _run_hidden_sitecustomize()
except Exception as err:  # as site.py does with a failing sitecustomize: say so, go on
    print(f"Error in sitecustomize: {type(err).__name__}: {err}", file=sys.stderr)
if os.environ.get("LLAMEM_MONITOR_LOG"):
    sys.meta_path.insert(0, _TrainerFinder())
