"""Whether the Python of a user-defined Keras layer's call did nothing but compute.

A built-in layer's call is a coarse unit (runtime/units.py): its Python is Keras' own and issues
the same ops whenever the layer, its settings and its inputs are the same, so co-execution skips
it whole. A user-defined layer's Python may do anything (draw a random number, count its calls,
append to a list, print), and skipping it would lose that. `watch()` runs the call under a
profile hook while it is traced and says whether it stayed within what a guard can check:

- code of Keras, TensorFlow, NumPy, optree and Terra is trusted (the same trust built-in layers
  get), and so is library code (the standard library, other installed packages) that trusted
  code calls;
- any other code that runs (the user's `call`, its helpers, library code the user's code calls
  directly) must be pure by its bytecode (`impure_opcode`): no store to an attribute, item,
  global or enclosing scope, no import, no generator; every global it reads is a module, class or
  function; it calls no C function but read-only builtins and methods of immutable values
  (`random.random`, `print`, `time.time`, `list.append` make it impure);
- every layer's call in the unit that is not Keras' own is checked even where library code
  calls it.

What a pure call reads besides its inputs is then the layers' attributes: `settings` puts their
plain values, and containers of plain values, in the guard, and `unguarded_attribute` names an
attribute the user's code reads that holds something no guard can compare (an arbitrary
object). Cost: only while tracing; skip mode pays the guard (`settings`) alone.
"""
from __future__ import annotations

import builtins
import dis
import math
import os
import sys
import types
from typing import Optional

__all__ = ["watch", "watching", "Watch", "suspend", "resume", "watched", "impure_opcode", "settings", "unguarded_attribute", "PLAIN", "freeze"]

# opcodes through which a code object changes state other than its own locals
_STATEFUL_OPS = frozenset({
    "STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR", "STORE_SLICE",
    "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_NAME", "DELETE_NAME", "LOAD_NAME",
    "IMPORT_NAME", "IMPORT_STAR", "YIELD_VALUE", "SEND", "GET_AWAITABLE", "GET_AITER",
    "GET_ANEXT", "SETUP_ANNOTATIONS", "DELETE_DEREF"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})

_PURE_BUILTINS = frozenset(id(f) for f in (
    len, isinstance, issubclass, min, max, abs, sum, any, all, round, divmod, pow, callable,
    sorted, hash, repr, format, ord, chr))
_IMMUTABLE = (str, bytes, tuple, frozenset, int, float, complex, bool, type(None), range)
_READ_METHODS = {dict: frozenset({"get", "keys", "values", "items", "copy", "__getitem__",
                                  "__contains__", "__len__"}),
                 list: frozenset({"index", "count", "copy", "__getitem__", "__contains__",
                                  "__len__"}),
                 set: frozenset({"issubset", "issuperset", "union", "intersection",
                                 "difference", "isdisjoint", "copy", "__contains__", "__len__"})}
PLAIN = (bool, int, float, str, type(None))
_PLAIN = PLAIN


def _package_dirs():
    dirs = []
    for name in ("keras", "tensorflow", "numpy", "optree", "terra"):
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if f:
            dirs.append(os.path.dirname(os.path.abspath(f)) + os.sep)
    return tuple(dirs)


def _library_dirs():
    import sysconfig
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.add(os.path.abspath(p) + os.sep)
    return tuple(dirs)


_TRUSTED = None
_LIBRARY = None
_CODE_VERDICTS: dict = {}  # code object -> (impure opcode or None, global names, attr names)


def _trusted_dirs():
    global _TRUSTED, _LIBRARY
    if _TRUSTED is None:
        _TRUSTED, _LIBRARY = _package_dirs(), _library_dirs()
    return _TRUSTED, _LIBRARY


_TRUSTED_FILE, _LIBRARY_FILE, _OTHER_FILE = 0, 1, 2
_FILE_KINDS: dict = {}  # co_filename -> one of the above (every call event asks)


def _file_kind(filename: str) -> int:
    trusted, library = _trusted_dirs()
    kind = _TRUSTED_FILE if filename.startswith(trusted) else \
        _LIBRARY_FILE if filename.startswith(library + ("<frozen ", "<string>")) else _OTHER_FILE
    _FILE_KINDS[filename] = kind
    return kind


def _code_facts(code):
    facts = _CODE_VERDICTS.get(code)
    if facts is None:
        bad, globs, attrs = None, set(), set()
        for ins in dis.get_instructions(code):
            if ins.opname in _STATEFUL_OPS and bad is None:
                bad = ins.opname
            elif ins.opname == "STORE_DEREF" and ins.argval not in code.co_cellvars and \
                    bad is None:
                bad = "STORE_DEREF"  # a write to an enclosing function's variable
            elif ins.opname == "LOAD_GLOBAL":
                globs.add(ins.argval)
            elif ins.opname in _ATTR_LOADS:
                attrs.add(ins.argval)
        facts = _CODE_VERDICTS[code] = (bad, frozenset(globs), frozenset(attrs))
    return facts


def impure_opcode(code) -> Optional[str]:
    """The first opcode of `code` that changes state other than its locals, or None."""
    return _code_facts(code)[0]


def _global_ok(value) -> bool:
    return isinstance(value, (types.ModuleType, type, types.FunctionType,
                              types.BuiltinFunctionType)) or value is None


def _c_call_ok(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    if owner is builtins:
        return id(fn) in _PURE_BUILTINS
    if owner is math:
        return True
    if getattr(owner, "__name__", None) == "_abc":  # isinstance on an ABC (caches only)
        return getattr(fn, "__name__", "") in ("_abc_instancecheck", "_abc_subclasscheck")
    if isinstance(owner, _IMMUTABLE):
        return True
    allowed = _READ_METHODS.get(type(owner))
    return allowed is not None and getattr(fn, "__name__", "") in allowed


class Watch:
    """The verdict of one watched call: `reason` is None while it stayed pure; `attributes`
    holds the attribute names the checked code loads."""

    def __init__(self, forced_codes=(), denied_codes=()):
        self.reason: Optional[str] = None
        self.attributes: set = set()
        self.complete = True  # False where nothing could be watched (another profiler)
        self._forced = frozenset(forced_codes)
        self._denied = frozenset(denied_codes)
        # by identity (the sets above hold the codes alive): a code object hashes its contents
        self._forced_ids = frozenset(id(c) for c in self._forced)
        self._denied_ids = frozenset(id(c) for c in self._denied)
        self._trust: dict = {}  # id(frame) -> trusted, for frames entered while watched
        self._trusted, self._library = _trusted_dirs()

    def _frame_trusted(self, frame) -> bool:
        t = self._trust.get(id(frame))
        if t is not None:
            return t
        return frame is not None and frame.f_code.co_filename.startswith(self._trusted)

    def _fail(self, why: str) -> None:
        if self.reason is None:
            self.reason = why
        sys.setprofile(None)  # the verdict is in: the rest of the call runs unwatched

    def __call__(self, frame, event, arg):
        if event == "c_return":  # the most frequent event, and nothing to do
            return
        if event == "call":
            code = frame.f_code
            if id(code) in self._denied_ids:
                return self._fail(f"calls {code.co_qualname}")
            if id(code) in self._forced_ids:
                trusted = False
            else:
                kind = _FILE_KINDS.get(code.co_filename)
                if kind is None:
                    kind = _file_kind(code.co_filename)
                trusted = kind == _TRUSTED_FILE or \
                    kind == _LIBRARY_FILE and self._frame_trusted(frame.f_back)
            self._trust[id(frame)] = trusted
            if not trusted:
                self._check_code(frame, code)
        elif event == "return":
            self._trust.pop(id(frame), None)
        elif event == "c_call":
            trusted = self._trust.get(id(frame))
            if trusted is None:
                trusted = self._frame_trusted(frame)
            if not trusted and not _c_call_ok(arg):
                self._fail(f"calls {getattr(arg, '__qualname__', arg)!s} "
                           f"({frame.f_code.co_filename}:{frame.f_lineno})")

    def _check_code(self, frame, code) -> None:
        where = f"{code.co_qualname} ({code.co_filename}:{code.co_firstlineno})"
        bad, globs, attrs = _code_facts(code)
        if bad is not None:
            return self._fail(f"{where} uses {bad}")
        if set(code.co_freevars) - {"__class__"} and id(frame.f_back) not in self._trust:
            return self._fail(f"{where} is a closure made outside the call")
        g = frame.f_globals
        b = g.get("__builtins__", builtins)
        b = b if isinstance(b, dict) else vars(b)
        for name in globs:
            value = g[name] if name in g else b.get(name)
            if not _global_ok(value):
                return self._fail(f"{where} reads global {name!r} "
                                  f"(a {type(value).__name__})")
        self.attributes |= attrs


_ACTIVE: list = []  # the watches open on this thread, innermost last


def suspend():
    """Stop watching while Terra's own bookkeeping runs (recording an op, locating it): it is
    trusted code, and under the profile hook every call and C call it makes costs an event
    (about a tenth of a traced step of a convolutional model). Returns the watch to `resume`,
    or None where none is installed."""
    w = sys.getprofile()
    if isinstance(w, Watch):
        sys.setprofile(None)
        return w
    return None


def resume(w) -> None:
    """Watch again after `suspend`, unless the verdict came in meanwhile (`Watch._fail`)."""
    if w is not None and w.reason is None:
        sys.setprofile(w)


def watched(w, fn):
    """`fn()` watched by `w` (suspended around it): an op's own execution inside a suspended
    dispatch, which may run Python (a `tf.py_function`)."""
    resume(w)
    try:
        return fn()
    finally:
        if sys.getprofile() is w:
            sys.setprofile(None)


def watching() -> bool:
    """Whether a watch is open on this thread (a call inside it is checked as part of it)."""
    return bool(_ACTIVE)


class watch:
    """`with watch(forced, denied) as w:` runs its body under the purity profile hook (forced:
    code objects checked wherever they run; denied: code objects that make the call impure
    wherever they run, trusted code's included: Keras' `add_loss`). Watches nest (a user layer inside a user layer): the
    inner one's verdict counts for the outer one too. Where another profiler is installed
    (cProfile), nothing is watched and `w.reason` says so."""

    def __init__(self, forced_codes=(), denied_codes=()):
        self.w = Watch(forced_codes, denied_codes)
        self._on = False

    def __enter__(self) -> Watch:
        outer = sys.getprofile()
        if outer is not None and not isinstance(outer, Watch):
            self.w.reason = "a profiler is installed"
            self.w.complete = False
            return self.w
        self._on = True
        _ACTIVE.append(self.w)
        sys.setprofile(self.w)
        return self.w

    def __exit__(self, *exc):
        if not self._on:
            return False
        sys.setprofile(None)
        _ACTIVE.pop()
        if _ACTIVE:
            parent = _ACTIVE[-1]
            if parent.reason is None and self.w.reason is not None:
                parent.reason = self.w.reason
            parent.attributes |= self.w.attributes
            if parent.reason is None:
                sys.setprofile(parent)
        return False


def freeze(value, depth=0):
    """A comparable copy of `value` if it is plain or a container of plain values, else
    raises TypeError."""
    if isinstance(value, _PLAIN):
        return value
    if depth < 2:
        if isinstance(value, (list, tuple)):
            return (type(value).__name__,) + tuple(freeze(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return ("dict",) + tuple((freeze(k, depth + 1), freeze(v, depth + 1))
                                     for k, v in value.items())
        if isinstance(value, (set, frozenset)):
            return ("set",) + tuple(sorted((freeze(v, depth + 1) for v in value), key=repr))
    raise TypeError(type(value).__name__)


def settings(obj, skip=frozenset()) -> tuple:
    """The plain values of `obj`'s attributes, and containers of plain values frozen (the
    guard of a user-defined layer)."""
    out = []
    for k, v in vars(obj).items():
        if k in skip:
            continue
        if isinstance(v, _PLAIN):
            out.append((k, v))
        elif isinstance(v, (list, tuple, dict, set, frozenset)):
            try:
                out.append((k, freeze(v)))
            except TypeError:
                pass  # layers, variables, Keras' own bookkeeping (judged where read)
    return tuple(out)


def unguarded_attribute(obj, names, inert) -> Optional[str]:
    """The first attribute among `names` of `obj` whose value a guard cannot compare: not
    plain, not a frozen container, and not `inert(value)` (a layer, a variable, a function,
    Keras' or TF's own object)."""
    d = vars(obj)
    for name in sorted(names):
        if name not in d:
            continue
        v = d[name]
        if isinstance(v, _PLAIN) or inert(v):
            continue
        if isinstance(v, (list, tuple, dict, set, frozenset)):
            try:
                freeze(v)
                continue
            except TypeError:
                items = v.values() if isinstance(v, dict) else v
                if all(isinstance(x, _PLAIN) or inert(x) for x in items):
                    continue
        return f"attribute {name!r} of {type(obj).__name__} holds a {type(v).__name__}"
    return None
