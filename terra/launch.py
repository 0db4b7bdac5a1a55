"""`python -m terra [options] train.py [args]`: run an unmodified program with Terra enabled.

The script runs as `__main__` with `sys.argv == ["train.py", *args]` and its directory first on
`sys.path`, exactly as `python train.py` would; `-m pkg.mod` runs a module the way `python -m`
does. An uncaught exception prints the program's own traceback (Terra's launcher frames left
out) and exits 1; `sys.exit(n)` exits n; Ctrl-C ends the process by SIGINT as Python does.

Options are `terra.config` settings, one flag per setting, derived from `terra.config.Config`:
a bool setting `x_y` is `--x-y` / `--no-x-y`, a number `--x-y N`; `--verbose` may repeat.
`--stats` prints `terra.summary()` to stderr when the program ends.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import signal
import sys

_HELP_TAIL = """
Environment: TERRA=1 enables Terra in a program started any other way (after
`python -m terra --install-env-hook`); any other value than 0 or 1 is read as
these options, e.g. TERRA="--stats --no-coexecution"."""


def _config_fields():
    from terra.config import Config
    return dataclasses.fields(Config)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m terra", description="Run a TensorFlow program with Terra enabled: every "
        "tf.GradientTape it opens is a Terra tape.", epilog=_HELP_TAIL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # no abbreviations: the program's own options come after it, and one of them that
        # abbreviates two of these (`--s`: `--stats`, `--site-graph`, ...) would stop the
        # launch as ambiguous before the program runs
        allow_abbrev=False)
    p.add_argument("--stats", action="store_true",
                   help="print terra.summary() to stderr when the program ends")
    p.add_argument("--install-env-hook", action="store_true",
                   help="install the TERRA environment-variable hook into this Python's "
                        "site-packages and exit")
    p.add_argument("--uninstall-env-hook", action="store_true",
                   help="remove that hook and exit")
    p.add_argument("-m", dest="module", metavar="MODULE",
                   help="run a module as `python -m MODULE` does")
    for f in _config_fields():
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=f"terra.config({f.name}=...)")
        elif f.name == "verbose":
            p.add_argument(flag, "-v", dest=f.name, action="count", default=None,
                           help="terra.config(verbose=...); repeat for more")
        else:
            kind = float if f.type in (float, "float") else int
            p.add_argument(flag, dest=f.name, type=kind, default=None, metavar="N",
                           help=f"terra.config({f.name}=...)")
    p.add_argument("script", nargs="?", help="the program (omit with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the program's own arguments")
    return p


def settings(ns) -> dict:
    """The `terra.config` changes the parsed options ask for."""
    return {f.name: getattr(ns, f.name) for f in _config_fields()
            if getattr(ns, f.name, None) is not None}


def configure(argv: list) -> argparse.Namespace:
    """Parse Terra's options (no program), apply them and enable Terra: the environment hook's
    path, where `TERRA` holds options."""
    ns = parser().parse_args(argv)
    if ns.script or ns.args or ns.module:
        raise SystemExit("terra: TERRA may hold options only, not a program: "
                         f"{' '.join(argv)!r}")
    _start(ns)
    return ns


def _start(ns) -> None:
    import atexit

    import terra
    changes = settings(ns)
    if changes:
        terra.config(**changes)
    terra.enable()
    if ns.stats:
        atexit.register(lambda: print(terra.summary(), file=sys.stderr, flush=True))


def _program_traceback(exc: BaseException):
    """The exception's traceback from the program's first frame on (launcher frames dropped)."""
    tb = exc.__traceback__
    here = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in here or
                              os.path.abspath(tb.tb_frame.f_code.co_filename) in here):
        tb = tb.tb_next
    return tb or exc.__traceback__


def main(argv: list | None = None) -> int:
    p = parser()
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.install_env_hook or ns.uninstall_env_hook:
        from terra import env_hook
        path = env_hook.install() if ns.install_env_hook else env_hook.uninstall()
        print(f"terra: {'installed' if ns.install_env_hook else 'removed'} {path}")
        return 0
    if ns.module and ns.script:
        ns.args = [ns.script, *ns.args]
        ns.script = None
    if not ns.module and not ns.script:
        p.error("a program to run is required (a script path, or -m MODULE)")
    if ns.script and not os.path.exists(ns.script):
        print(f"{sys.executable}: can't open file {os.path.abspath(ns.script)!r}: "
              "[Errno 2] No such file or directory", file=sys.stderr)
        return 2
    _start(ns)
    try:
        if ns.module:
            sys.argv = [ns.module, *ns.args]
            runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [ns.script, *ns.args]
            sys.path[0] = os.path.dirname(os.path.abspath(ns.script))
            runpy.run_path(ns.script, run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt as e:
        tb = _program_traceback(e)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        _end_program()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # the exit status of a Python killed by Ctrl-C
        return 130
    except BaseException as e:  # noqa: BLE001 - printed as Python prints an uncaught one
        tb = _program_traceback(e)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        _end_program()
        return 1
    return 0 if _end_program() else 1


def _end_program() -> bool:
    """Finish the last iteration while the program's objects are alive. An error that raises
    (a late op error of the last step) is the program's: printed as uncaught; returns False."""
    import terra
    try:
        terra.end_iteration()
    except Exception as e:  # noqa: BLE001
        sys.excepthook(type(e), e, e.__traceback__)
        return False
    return True
