"""`TERRA=1 python train.py`: Terra enabled in a program started by a launcher that does not run
`python -m terra`.

`python -m terra --install-env-hook` writes `terra-env.pth` into this Python's site-packages.
Python runs that file's one line at start-up; it costs an environment lookup when `TERRA` is
unset or `0`. Otherwise it loads this module on its own (not as part of the `terra` package, so
TensorFlow is not imported at start-up: a program may still set `TF_CPP_MIN_LOG_LEVEL` or
`CUDA_VISIBLE_DEVICES` before its own `import tensorflow`) and arms `after_import`: once the
program's `import tensorflow` completes, Terra is imported and enabled with the options `TERRA`
holds (`1`: the defaults; otherwise `python -m terra` options, e.g. `--stats --xla`).

Only the standard library at module level: this file runs before `sys.path` is complete.
"""
from __future__ import annotations

import importlib.abc
import os
import shlex
import sys
import sysconfig

PTH_NAME = "terra-env.pth"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls the functions registered for a module right after its import completes."""

    def __init__(self):
        self.waiting: dict = {}

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, fns = spec.loader, self.waiting.pop(name)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            for fn in fns:
                fn()
        loader.exec_module = exec_module
        return spec


_finder: _AfterImport | None = None


def after_import(name: str, fn) -> None:
    """Call `fn()` once module `name` has been imported: now if it already is, else right after
    the import that loads it completes."""
    global _finder
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        fn()
        return
    if _finder is None:
        _finder = _AfterImport()
        sys.meta_path.insert(0, _finder)
    _finder.waiting.setdefault(name, []).append(fn)


def options(value: str) -> list:
    """`TERRA`'s value as `python -m terra` options (`1`: none)."""
    return [] if value.strip() in ("1", "") else shlex.split(value)


def arm() -> None:
    """Enable Terra once TensorFlow is imported, with the options in `TERRA`."""
    argv = options(os.environ.get("TERRA", "1"))

    def start():
        from terra.launch import configure
        configure(argv)
    after_import("tensorflow", start)


def pth_line(path: str | None = None) -> str:
    """The `.pth` line: an environment lookup, and when `TERRA` is set, `arm()` of this file
    loaded as a module of its own."""
    path = os.path.abspath(path or __file__)
    return ("import os; exec(\"import importlib.util as u\\n"
            "s = u.spec_from_file_location('terra_env_hook', %r)\\n"
            "m = u.module_from_spec(s); s.loader.exec_module(m); m.arm()\") "
            "if os.environ.get('TERRA', '0') not in ('', '0') else None\n" % path)


def site_dir() -> str:
    return sysconfig.get_paths()["purelib"]


def install(directory: str | None = None) -> str:
    target = os.path.join(directory or site_dir(), PTH_NAME)
    with open(target, "w") as f:
        f.write(pth_line())
    return target


def uninstall(directory: str | None = None) -> str:
    target = os.path.join(directory or site_dir(), PTH_NAME)
    if os.path.exists(target):
        os.remove(target)
    return target
