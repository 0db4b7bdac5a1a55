"""The recorder: executes every op of an iteration eagerly and writes it down as a `Trace`.

    with Recorder("train_step") as rec:
        loss = step(x, y)
    trace = rec.trace              # OpRecords, feeds, fetches, variables
    loss_ref = rec.ref_of(loss)    # OutputRef of the record that produced `loss`

Inputs become SSA refs: outputs of earlier records (`OutputRef`, by tensor identity: the recorder
keeps recorded tensors alive, so ids cannot be reused), variables (`VariableRef`, by identity of
the resource handle), small constants made from Python values in this iteration (`ConstRef`, by
value), and everything else external (`FeedRef`: data, tensors from before the iteration, NumPy
arrays, large constants). Anything the recorder cannot represent is named in `Trace.unsupported`
(the iteration itself still ran eagerly, so nothing is lost but the chance to compile it).
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.ir.op_kinds import HOST_OPS
from terra.ir.records import (ConstRef, Feed, FeedRef, Fetch, OpRecord, OutputRef, TensorSpec,
                              Trace, VariableRef)
from terra.tracing import hook
from terra.tracing import gc_window
from terra.tracing.locations import Locator, code_info, pause_tracking, resume_tracking

DEFAULT_CONST_LIMIT = 16

# Ops whose replay would create or destroy state instead of reusing it.
STATE_CREATING_OPS = frozenset({"VarHandleOp", "DestroyResourceOp", "_VarHandlesOp",
                                "AnonymousIteratorV2", "AnonymousIteratorV3", "IteratorV2"})

UNREPLAYABLE_EXTERNAL_DTYPES = frozenset({"variant", "resource"})

# `tf.py_function` / `tf.numpy_function`: each call registers its Python function under a new
# `token` attr, and the op calls whatever function its token names. A graph holding the op would
# call the first call's function (a closure over that step's Python state) every step after, so
# a path holding one is not compiled; its token is not recorded, so that the path is one path
# whatever call made it, and `explain()` says why once.
PY_FUNC_OPS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})


# ------------------------------------------------------------------------------- attr freezing
def _shape(v):
    s = tf.TensorShape(v)
    return None if s.rank is None else tuple(s.as_list())


def _string(v):
    return v.decode() if isinstance(v, bytes) else str(v)


_dtype_names: dict = {}


def _dtype_name(v) -> str:
    try:
        return _dtype_names[v]
    except (KeyError, TypeError):
        name = tf.as_dtype(v).name
        try:
            _dtype_names[v] = name
        except TypeError:  # unhashable (e.g. a numpy dtype subclass instance)
            pass
        return name


_FREEZE = {
    "type": _dtype_name,
    "list(type)": lambda v: tuple(_dtype_name(x) for x in v),
    "shape": _shape,
    "list(shape)": lambda v: tuple(_shape(x) for x in v),
    "int": int, "float": float, "bool": bool, "string": _string,
    "list(int)": lambda v: tuple(int(x) for x in v),
    "list(float)": lambda v: tuple(float(x) for x in v),
    "list(bool)": lambda v: tuple(bool(x) for x in v),
    "list(string)": lambda v: tuple(_string(x) for x in v),
}


def freeze_attr(attr_type: str, value):
    """Canonical hashable form of an attr value of op_def type `attr_type`; raises TypeError for
    types Terra does not replay (func, tensor, ...)."""
    f = _FREEZE.get(attr_type)
    if f is None:
        raise TypeError(f"attr type {attr_type!r} is not supported")
    return f(value)


def _from_proto(av, attr_type: str):
    """Python value of an AttrValue proto (op_def defaults)."""
    kind = av.WhichOneof("value")
    if kind == "list":
        field = {"list(int)": "i", "list(float)": "f", "list(bool)": "b", "list(string)": "s",
                 "list(type)": "type", "list(shape)": "shape"}.get(attr_type)
        if field is None:
            raise TypeError(f"attr type {attr_type!r} is not supported")
        return freeze_attr(attr_type, list(getattr(av.list, field)))
    if kind == "shape":
        return None if av.shape.unknown_rank else tuple(
            None if d.size < 0 else d.size for d in av.shape.dim)
    if kind in ("i", "f", "b", "s", "type"):
        return freeze_attr(attr_type, getattr(av, kind))
    raise TypeError(f"attr type {attr_type!r} is not supported")


def _pairs(flat) -> list:  # (name, value, name, value, ...) -> [(name, value), ...]
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def _python_dtype(v) -> str:
    """Dtype TF picks when converting a Python value without a requested dtype."""
    a = np.asarray(v)
    if a.dtype == np.float64:
        return "float32"
    if a.dtype == np.int64:
        return "int32" if a.size == 0 or (np.abs(a) < 2 ** 31).all() else "int64"
    if a.dtype.kind in "US":
        return "string"
    return tf.as_dtype(a.dtype).name


def frozen_value(value, dtype: str):
    """Hashable by-value form of a small constant (nested tuples of Python scalars)."""
    if dtype == "string":
        a = np.asarray(value, dtype=object)
        conv = np.vectorize(lambda s: s.encode() if isinstance(s, str) else bytes(s), otypes=[object])
        a = conv(a) if a.size else a
    else:
        a = np.asarray(value, dtype=tf.as_dtype(dtype).as_numpy_dtype)

    def tup(x):
        return tuple(tup(e) for e in x) if isinstance(x, list) else x
    return tup(a.tolist())


def _made_in_library(array) -> bool:
    """Whether library code made `array`: the outermost library frame of the current call (the
    TF / Keras function the program called) does not hold it among its locals (arguments
    included, one level into tuples and lists), so the program did not pass it in."""
    f, entry = sys._getframe(1), None
    while f is not None:
        info = code_info(f.f_code)
        if info.library:
            entry = f
        elif not info.internal:
            break
        f = f.f_back
    if entry is None:
        return False
    for v in entry.f_locals.values():
        if v is array or isinstance(v, (tuple, list)) and any(e is array for e in v):
            return False
    return True


def is_python_value(v) -> bool:
    if isinstance(v, (bool, int, float, complex, str, bytes, np.generic)):
        return True
    if isinstance(v, (list, tuple)):
        return all(is_python_value(e) for e in v)
    return False


def _flat_outputs(result) -> list:
    if result is None:
        return []
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


_specs: dict = {}


def _spec(t) -> TensorSpec:
    """TensorSpec of an eager tensor (interned: most specs repeat)."""
    key = (t._datatype_enum(), t._shape_tuple())  # pylint: disable=protected-access
    spec = _specs.get(key)
    if spec is None:
        shape = key[1]
        spec = _specs[key] = TensorSpec(t.dtype.name, None if shape is None else tuple(shape))
    return spec


class OpInfo:
    """What the recorder needs from an op_def, computed once per op type."""
    __slots__ = ("op_def", "inputs", "outputs", "attr_types", "defaults")

    def __init__(self, op_def):
        self.op_def = op_def
        # (type_attr, number_attr, type_list_attr, fixed dtype name or None) per input / output
        self.inputs = tuple(_arg_info(a) for a in op_def.input_arg)
        self.outputs = tuple(_arg_info(a) for a in op_def.output_arg)
        self.attr_types = {a.name: a.type for a in op_def.attr}
        self.defaults = {}
        for a in op_def.attr:
            if a.HasField("default_value"):
                try:
                    self.defaults[a.name] = _from_proto(a.default_value, a.type)
                except TypeError:
                    pass  # a func/tensor default: only a problem if the op is recorded


def _arg_info(a) -> tuple:
    return (a.type_attr, a.number_attr, a.type_list_attr,
            tf.as_dtype(a.type).name if a.type else None)


_op_infos: dict = {}


def op_info(op_type: str):
    info = _op_infos.get(op_type)
    if info is None:
        op_def = tfp.get_op_def(op_type)
        if op_def is None:
            return None
        info = _op_infos[op_type] = OpInfo(op_def)
    return info


class _Unsupported(Exception):
    """Raised inside the recorder when an op cannot be represented; the op still ran eagerly."""


# ---------------------------------------------------------------------------------- the recorder
class Recorder(hook.Interceptor):
    """Records one iteration on the calling thread. See the module docstring for the model.

    Recorder(site="iteration", *, const_limit=16, track_loops=True, young_gc=0)
      young_gc: while recording, the garbage collector's young generation collects after at
                least this many allocations (gc_window.py; 0: the collector is left alone).
      start(root_frame=None)  begin recording; locations are relative to `root_frame` (default:
                              the caller's frame); loops running at that point are not counted.
      stop() -> Trace         stop recording (the hook is uninstalled when no one else uses it).
      with Recorder(...) as rec: ...   same as start()/stop().
      ref_of(tensor) -> OutputRef | None   which record produced this eager tensor.
      value(ref) -> EagerTensor            the recorded value of an OutputRef.
    """

    def __init__(self, site: str = "iteration", *, const_limit: int = DEFAULT_CONST_LIMIT,
                 track_loops: bool = True, young_gc: int = 0):
        if not isinstance(site, str):
            raise TypeError(f"Recorder: site must be a str, got {site!r}")
        if not isinstance(const_limit, int) or const_limit < 0:
            raise ValueError(f"Recorder: const_limit must be a non-negative int, got {const_limit!r}")
        self.trace = Trace(site)
        if not isinstance(young_gc, int) or young_gc < 0:
            raise ValueError(f"Recorder: young_gc must be a non-negative int, got {young_gc!r}")
        self.const_limit = const_limit
        self.track_loops = track_loops
        self.young_gc = young_gc
        self._produced: dict = {}   # id(tensor) -> (tensor, OutputRef)
        self._born: dict = {}       # id(tensor) -> (tensor, python value): converted this iteration
        self._library_arrays: set = set()  # ids of `_born` tensors made from library-made arrays
        self._origins: dict = {}    # id(tensor) -> (tensor, n): `ConstRef.origin` of a constant
        self._next_origin = 0
        self._copies: dict = {}     # id(array) -> (array, tensor): constant_value copies
        self._feeds: dict = {}      # id(obj) -> (obj, FeedRef)
        self._handles: dict = {}    # id(handle) -> (handle, variable or None)
        self._functions: dict = {}  # name -> AtomicFunction seen via call_flat
        self._fast_failed: str | None = None  # op type whose fast-path attempt just fell back
        self._problems: list = []               # why the op being recorded cannot be replayed
        self._locator = None
        self._token = None
        self.recording = False

    # ---------------------------------------------------------------------------- lifecycle
    def start(self, root_frame=None, resume=None, root_lasti=None) -> "Recorder":
        """`resume` / `root_lasti`: see `Locator` (a recording that starts mid-iteration)."""
        if self.recording:
            raise RuntimeError("Recorder.start(): already recording")
        root = sys._getframe(1) if root_frame is None else root_frame
        hook.install()
        try:
            self._token = hook.activate(self)
        except Exception:
            hook.uninstall()
            raise
        self._locator = Locator(root, track_loops=self.track_loops, resume=resume,
                                root_lasti=root_lasti)
        gc_window.widen(self.young_gc)
        self.recording = True
        return self

    def stop(self) -> Trace:
        if not self.recording:
            raise RuntimeError("Recorder.stop(): not recording")
        self.recording = False
        gc_window.restore()
        self._locator.close()
        hook.deactivate(self._token)
        hook.uninstall()
        self._born.clear()
        self._library_arrays.clear()
        self._origins.clear()
        self._copies.clear()
        return self.trace

    def release(self) -> None:
        """Drop the iteration's values the recorder maps to their records (every op output, the
        feeds it saw), once its trace is filed. They are a whole step's tensors, activations
        included; the iteration that owns the recorder may live on in a reference cycle until
        a full garbage collection (a fallback's, with its runner), holding them all."""
        self._produced.clear()
        self._feeds.clear()

    def __enter__(self) -> "Recorder":
        return self.start(sys._getframe(1))

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------------------- queries
    def ref_of(self, tensor):
        entry = self._produced.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def born_ids(self) -> frozenset:
        """Ids of the tensors converted from Python values so far this iteration."""
        return frozenset(self._born)

    def born_value(self, tensor):
        """The Python value `tensor` was converted from this iteration, or None."""
        entry = self._born.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def produced(self):
        """`(tensor, OutputRef)` of every op output recorded so far."""
        return self._produced.values()

    def feed_ref(self, value):
        """The FeedRef `value` entered the trace as (itself, not an equal value), or None."""
        e = self._feeds.get(id(value))
        return e[1] if e is not None and e[0] is value else None

    def retry_on_slow_route(self, op_type: str) -> None:
        """`op_type`'s fast-path attempt was refused before this recorder took over (skip mode
        diverged there): its record keeps the fast-path-first route, as eager's would."""
        self._fast_failed = op_type

    def value(self, ref: OutputRef):
        for t, r in self._produced.values():
            if r == ref:
                return t
        raise KeyError(f"Recorder.value: no recorded tensor for {ref!r}")

    # ---------------------------------------------------------------------- hook callbacks
    def converted(self, value, dtype, tensor) -> None:
        self._born[id(tensor)] = (tensor, value)
        if isinstance(value, np.ndarray) and self._small_array(value) and _made_in_library(value):
            self._library_arrays.add(id(tensor))  # (`_born` keeps the tensor alive)

    def value_copy(self, tensor, value) -> None:
        # a copy of a constant or feed (not of an op's output: those stay reads) is that
        # constant or feed where an op takes it (a slice's bounds in the slice's gradient)
        if value.size <= self.const_limit and self.ref_of(tensor) is None and \
                tensor.dtype.name not in ("resource", "variant", "string"):
            self._copies[id(value)] = (value, tensor)

    def _copied(self, v, dtype):
        """The tensor NumPy `v` is an unchanged `constant_value` copy of, or None."""
        e = self._copies.get(id(v))
        if e is None or e[0] is not v:
            return None
        t = e[1]
        if (dtype or tf.as_dtype(v.dtype).name) != t.dtype.name or v.dtype != t.dtype.as_numpy_dtype \
                or not np.array_equal(v, t.numpy()):
            return None
        return t

    def _origin(self, tensor) -> int:
        e = self._origins.get(id(tensor))
        if e is None or e[0] is not tensor:
            e = self._origins[id(tensor)] = (tensor, self._next_origin)
            self._next_origin += 1
        return e[1]

    def variable_handle(self, variable, handle) -> None:
        self._handles[id(handle)] = (handle, variable)

    def function(self, fn) -> None:
        self._functions[tfp.atomic_function_name(fn)] = fn
        # The variables a function captured, by handle: their handles reach `_variable` as
        # captured inputs without passing through the `handle` property, and this saves the
        # frame search of `_owner_of_handle`.
        for var in getattr(getattr(fn, "graph", None), "variables", None) or ():
            handle = getattr(var, "_handle", None)
            if handle is not None:
                self._handles.setdefault(id(handle), (handle, var))

    def fetch(self, tensor, how: str) -> None:
        ref = self.ref_of(tensor)
        if ref is not None:
            self.trace.fetches.append(Fetch(ref, len(self.trace.records), how))

    wants_shape_reads = True

    def shape_read(self, tensor) -> None:
        ref = self.ref_of(tensor)
        if ref is not None:
            self.trace.shape_reads.setdefault(ref, len(self.trace.records))

    def op(self, op_type, inputs, attrs, route, run):
        paused = pause_tracking()
        try:
            return self._op(op_type, inputs, attrs, route, run)
        finally:
            resume_tracking(paused)

    def _op(self, op_type, inputs, attrs, route, run):
        location = self._locator.location(sys._getframe(3))
        try:
            result = run()
        except tfp.FallbackException:
            self._fast_failed = op_type
            raise
        fast_failed = self._fast_failed
        if route == "fallback" and fast_failed is not None:  # ops in between are its conversions
            self._fast_failed = None
        try:
            self._record(op_type, inputs, attrs, route, result, location)
        except Exception as e:  # never let bookkeeping break the user's iteration
            self._record_unsupported(op_type, route, result, location, f"{type(e).__name__}: {e}")
        if fast_failed == op_type and route == "fallback":
            self.trace.fast_fallbacks.append(len(self.trace.records) - 1)
        return result

    # ------------------------------------------------------------------------- recording
    def _record(self, op_type, inputs, attrs, route, result, location) -> None:
        trace = self.trace
        index = len(trace.records)
        self._problems = []
        outputs = _flat_outputs(result)
        function = None
        if route == "function":
            fn = self._functions.get(op_type)
            if fn is None:
                self._problems.append("unknown function")
            else:
                trace.functions[op_type] = fn
            function = op_type
            refs = tuple(self._ref(v, None) for v in inputs)
            frozen = tuple(sorted(_pairs(attrs)))
        else:
            info = op_info(op_type)
            if info is None:
                raise _Unsupported("no op definition")
            if route == "fast":
                per_arg = inputs
                full = self._fast_attrs(info, per_arg, attrs, outputs)
            else:
                full = self._frozen_attrs(info, attrs)
                per_arg = _regroup(info, list(inputs), full)
            refs = tuple(self._arg_refs(arg, v, full) for arg, v in zip(info.inputs, per_arg))
            if op_type in HOST_OPS:  # eager's per-call seeds: a host op runs as the program says
                full = {k: v for k, v in full.items() if k not in ("seed", "seed2")}
            elif op_type in PY_FUNC_OPS:
                full = {k: v for k, v in full.items() if k != "token"}
                self._problems.append("runs Python inside an op (tf.py_function)")
            frozen = tuple(sorted(full.items()))
            if op_type in STATE_CREATING_OPS:
                self._problems.append("creates state")
        rec = OpRecord(index, op_type, frozen, refs, tuple(_spec(t) for t in outputs), location,
                       route, function, tfp.tapes_recording())
        if op_type in HOST_OPS:
            # skip mode runs it on fetched inputs (fetch them from the first graph on), and its
            # outputs are data from outside the graph: whoever consumes them takes a feed
            for v in inputs:
                for e in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(e, tfp.EagerTensorBase):
                        self.fetch(e, "host-op")
            outputs = []
        self._add(rec, outputs)
        for problem in self._problems:
            trace.unsupported.append(f"{op_type}: {problem}")
            if trace.first_unsupported is None:
                trace.first_unsupported = rec.index

    def _record_unsupported(self, op_type, route, result, location, why) -> None:
        outputs = _flat_outputs(result)
        specs = []
        for t in outputs:
            try:
                specs.append(_spec(t))
            except Exception:  # not a tensor at all
                specs.append(TensorSpec("unknown", None))
        rec = OpRecord(len(self.trace.records), op_type, (), (), tuple(specs), location, route,
                       op_type if route == "function" else None, tfp.tapes_recording())
        self._add(rec, [t for t in outputs if isinstance(t, tfp.EagerTensorBase)])
        self.trace.unsupported.append(f"{op_type}: {why}")
        if self.trace.first_unsupported is None:
            self.trace.first_unsupported = rec.index

    def _add(self, rec: OpRecord, outputs) -> None:
        self.trace.records.append(rec)
        for j, t in enumerate(outputs):
            self._produced[id(t)] = (t, OutputRef(rec.index, j))

    # ------------------------------------------------------------------------------ attrs
    def _frozen_attrs(self, info: OpInfo, flat, defaults: bool = True) -> dict:
        types = info.attr_types
        full = {}
        for i in range(0, len(flat), 2):
            name, value = flat[i], flat[i + 1]
            attr_type = types.get(name)
            if attr_type is None:
                raise _Unsupported(f"unknown attr {name!r}")
            if value is None and attr_type != "shape":
                continue  # None means "the default" (e.g. Squeeze's axis)
            full[name] = freeze_attr(attr_type, value)
        if defaults:
            self._add_defaults(info, full)
        return full

    def _add_defaults(self, info: OpInfo, full: dict) -> None:
        for name, value in info.defaults.items():
            if name not in full:
                full[name] = value

    def _fast_attrs(self, info: OpInfo, per_arg, attrs, outputs) -> dict:
        """The fast path passes only non-inferred attrs: infer the rest from inputs and outputs."""
        full = self._frozen_attrs(info, attrs, defaults=False)
        for (type_attr, number_attr, type_list_attr, _), v in zip(info.inputs, per_arg):
            if number_attr and number_attr not in full:
                full[number_attr] = len(v)
            if type_list_attr and type_list_attr not in full:
                full[type_list_attr] = tuple(self._dtype_of(e) for e in v)
            if type_attr and type_attr not in full:
                d = self._tensor_dtype(v)
                if d is not None:
                    full[type_attr] = d
        # Outputs are authoritative for the attrs they depend on.
        pos = 0
        for type_attr, number_attr, type_list_attr, _ in info.outputs:
            n = 1
            if number_attr:
                n = full.get(number_attr, 1)
            elif type_list_attr:
                n = len(full.get(type_list_attr, ()))
            if type_attr and pos < len(outputs):
                full[type_attr] = _spec(outputs[pos]).dtype
            pos += n
        for (type_attr, _, _, _), v in zip(info.inputs, per_arg):  # Python-only inputs
            if type_attr and type_attr not in full:
                full[type_attr] = _python_dtype(v)
        self._add_defaults(info, full)
        return full

    def _tensor_dtype(self, v):
        items = v if isinstance(v, (list, tuple)) else [v]
        for e in items:
            if isinstance(e, tfp.EagerTensorBase):
                return e.dtype.name
            if isinstance(e, tfp.BaseResourceVariable):
                return e.dtype.name
            if isinstance(e, np.ndarray):
                return tf.as_dtype(e.dtype).name
        return None

    def _dtype_of(self, e) -> str:
        d = self._tensor_dtype(e)
        return d if d is not None else _python_dtype(e)

    # ------------------------------------------------------------------------------- refs
    def _arg_refs(self, arg, value, full):
        type_attr, number_attr, type_list_attr, fixed = arg
        if number_attr or type_list_attr:
            dtypes = (full[type_list_attr] if type_list_attr
                      else [full.get(type_attr) if type_attr else fixed] * len(value))
            return tuple(self._ref(e, d) for e, d in zip(value, dtypes))
        return self._ref(value, full.get(type_attr) if type_attr else fixed)

    def _ref(self, v, dtype):
        """Ref for one input value; `dtype` is what the op expects (None: take the value's)."""
        if isinstance(v, tfp.EagerTensorBase):
            entry = self._produced.get(id(v))
            if entry is not None and entry[0] is v:
                return entry[1]
            if v.dtype.name == "resource":
                return self._variable(v)
            fed = self._feeds.get(id(v))
            if fed is not None and fed[0] is v:
                # already a feed (a recorder seeded from a skipped prefix: a Python value the
                # path feeds, converted while skipping): every later use is that feed too, the
                # gradient's included, never a constant of this step's value
                return fed[1]
            born = self._born.get(id(v))
            if born is not None and born[0] is v and is_python_value(born[1]):
                if v.shape.num_elements() <= self.const_limit and v.dtype.name != "string" or \
                        v.dtype.name == "string" and v.shape.rank == 0:
                    return ConstRef(frozen_value(born[1], v.dtype.name), v.dtype.name,
                                    self._origin(v))
                return self._feed(v, _spec(v), "python-constant")
            if born is not None and born[0] is v and isinstance(born[1], np.ndarray):
                if id(v) in self._library_arrays and v.dtype.name != "string":
                    return ConstRef(frozen_value(born[1], v.dtype.name), v.dtype.name,
                                    self._origin(v))
                # The user's array is the feed value, so it can be substituted by identity.
                return self._feed(v, _spec(v), "numpy", value=born[1])
            return self._feed(v, _spec(v), "eager-tensor")
        if isinstance(v, tfp.BaseResourceVariable):
            h = v.handle
            self._handles.setdefault(id(h), (h, v))
            return self._variable(h)
        if isinstance(v, np.ndarray):
            t = self._copied(v, dtype)
            if t is not None:
                return self._ref(t, dtype)
            d = dtype or tf.as_dtype(v.dtype).name
            return self._feed(v, TensorSpec(d, tuple(v.shape)), "numpy")
        if is_python_value(v):
            d = dtype or _python_dtype(v)
            a = np.asarray(v)
            if a.size <= self.const_limit:
                return ConstRef(frozen_value(v, d), d)
            return self._feed(v, TensorSpec(d, tuple(a.shape)), "python-constant")
        raise _Unsupported(f"input of type {type(v).__name__}")

    def _small_array(self, a: np.ndarray) -> bool:
        """A NumPy array that library code (TF, Keras) made itself during this iteration (e.g.
        the axes `reduce_mean` builds with `np.arange`) with at most `const_limit` numeric
        elements is a constant by value, like a small Python literal, so loops that build one
        per iteration keep their feed slots aligned and fold. Safe: the value is copied when
        recorded and merge compares constants by value, so a value that changes between
        iterations makes a different trace (a new branch), never a stale constant. Arrays the
        program passes in (user data) stay feeds: see `_made_in_library`."""
        return a.size <= self.const_limit and a.dtype.kind in "biufc"

    def _feed(self, obj, spec: TensorSpec, source: str, value=None) -> FeedRef:
        """Feed slot for external object `obj` (one slot per object); `value` (default `obj`)
        is what `trace.feed_values` records for it."""
        entry = self._feeds.get(id(obj))
        if entry is not None and entry[0] is obj:
            return entry[1]
        if spec.dtype in UNREPLAYABLE_EXTERNAL_DTYPES:
            self._problems.append(f"external {spec.dtype} input")
        trace = self.trace
        ref = FeedRef(len(trace.feeds))
        trace.feeds.append(Feed(ref.slot, spec, source))
        trace.feed_values.append(obj if value is None else value)
        self._feeds[id(obj)] = (obj, ref)
        return ref

    def _variable(self, handle) -> VariableRef:
        key = id(handle)
        var = self.trace.variables.get(key)
        if var is None:
            entry = self._handles.get(key)
            var = entry[1] if entry is not None and entry[0] is handle else _owner_of_handle(handle)
            if var is None:  # a resource no variable owns: keep the handle itself (captured)
                var = handle
            self._handles[key] = (handle, var)
            self.trace.variables[key] = var
        return VariableRef(key)


def _regroup(info: OpInfo, flat, full) -> list:
    """Flat fallback-route inputs -> one entry per op_def input arg (lists for list args)."""
    out, pos = [], 0
    for _, number_attr, type_list_attr, _ in info.inputs:
        if number_attr or type_list_attr:
            n = full[number_attr] if number_attr else len(full[type_list_attr])
            out.append(flat[pos:pos + n])
            pos += n
        else:
            out.append(flat[pos])
            pos += 1
    if pos != len(flat):
        raise _Unsupported(f"{len(flat)} flat inputs do not match the op definition")
    return out


_OWNER_SEARCH_FRAMES = 40


def _owner_of_handle(handle):
    """The resource variable whose handle is `handle`, when no `handle` property access, function
    capture or PythonRunner map named it: found among the locals of the calling frames (a
    variable method that reads `self._handle` directly has the variable as `self`). None if it
    is not there: the recorder then keeps the bare handle (replay reads and writes it by handle,
    snapshots too). No heap scan: `gc.get_referrers` can crash the process while other threads
    create objects."""
    f = sys._getframe(1)
    for _ in range(_OWNER_SEARCH_FRAMES):
        if f is None:
            break
        for v in f.f_locals.values():
            if isinstance(v, tfp.BaseResourceVariable) and getattr(v, "_handle", None) is handle:
                return v
        f = f.f_back
    return None


def _is_placeholder(v) -> bool:
    """A runtime placeholder (anything with `_terra_materialize`: tracing does not import the
    runtime, as the hook does not). Asked of every input of every op a fallback records: the
    answer is kept per type (a missed `hasattr` raises and catches an AttributeError)."""
    t = type(v)
    known = _PLACEHOLDER_TYPES.get(t)
    if known is None:
        known = _PLACEHOLDER_TYPES[t] = hasattr(t, "_terra_materialize")
    return known


_PLACEHOLDER_TYPES: dict = {}


def _real(v):
    """A placeholder's real value; anything else as it is."""
    return v._terra_materialize() if _is_placeholder(v) else v


# ------------------------------------------------------------------------- continuing a prefix
def _as_replayed(rec, env):
    """`rec` with the output shapes its replay gave: an op whose output shape depends on data
    (`tf.where`) or on a value (`tf.range(n)`) may have had another shape when first traced."""
    outs = rec.outputs
    for j, spec in enumerate(outs):
        v = env.get((rec.index, j))
        shape = getattr(v, "shape", None)
        if shape is not None and spec.shape is not None and tuple(shape) != spec.shape:
            outs = outs[:j] + (TensorSpec(spec.dtype, tuple(shape)),) + outs[j + 1:]
    return rec if outs is rec.outputs else dataclasses.replace(rec, outputs=outs)


class ContinuingRecorder(Recorder):
    """A Recorder that understands placeholders (by their real value) and can start from a prefix
    of an earlier trace; it stops recording (marking the trace unsupported) past `max_ops`."""

    def __init__(self, site, max_ops: int = 50000, young_gc: int = 0):
        super().__init__(site, young_gc=young_gc)
        self.max_ops = max_ops
        self.units: dict = {}   # start -> GradUnit
        self.too_long = False
        self.in_unit = False   # inside tape.gradient / apply_gradients (TF's own constants)
        self.unit_depth = 0    # inside any coarse unit being recorded (its reads: Fetch.in_unit)
        self.muted = 0         # inside Terra's own reads (not fetches)
        self.unit_reads = None  # while a coarse unit's Python runs: its (ref, value) reads

    def seed(self, trace: Trace, upto: int, feed_values: dict, env: dict, placeholders: dict,
             units: dict, fetches=(), replay=None, born=None) -> None:
        """Start from `trace.records[:upto]` whose outputs are `env[(record, index)]`."""
        t = self.trace
        t.records = [_as_replayed(r, env) for r in trace.records[:upto]]
        self._next_origin = 1 + max((r.origin for rec in t.records for r in rec.input_refs()
                                     if isinstance(r, ConstRef) and r.origin is not None),
                                    default=-1)
        used = sorted(feed_values)
        if used != list(range(len(used))):
            raise ValueError(f"fallback: fed slots {used} are not a prefix of the feed table")
        t.feeds = [Feed(s, trace.feeds[s].spec, trace.feeds[s].source) for s in used]
        t.feed_values = [feed_values[s] for s in used]
        for s in used:
            v = feed_values[s]
            self._feeds[id(v)] = (v, FeedRef(s))
            if _is_placeholder(v) and v.is_materialized:
                real = v._terra_materialize()
                self._feeds[id(real)] = (real, FeedRef(s))
        t.variables = dict(trace.variables)
        for key, var in trace.variables.items():
            if isinstance(var, tfp.BaseResourceVariable):
                self._handles[key] = (var.handle, var)
        t.functions = dict(trace.functions)
        t.fast_fallbacks = [i for i in trace.fast_fallbacks if i < upto]
        t.unseeded_random = [i for i in trace.unseeded_random if i < upto]
        t.fetches = list(fetches)
        for (i, j), value in env.items():
            self._produced[id(value)] = (value, OutputRef(i, j))
        self.units = {s: u for s, u in units.items() if u.end <= upto}
        for key, (t, value) in (born or {}).items():  # converted while skipping: constants
            self._born[key] = (t, value)
        if replay is not None:  # tensors the replay made: tapes hold them, gradients read them
            for ref, c in replay.consts.items():
                self._born[id(c)] = (c, ref.value)
            for slot, t in replay.converted.items():
                self._feeds[id(t)] = (t, FeedRef(slot))
        self._keep = (env, placeholders)

    def release_seed(self) -> None:
        """Drop the prefix's values and placeholders `seed` kept alive (once they are bound)."""
        self._keep = None

    def _ref(self, v, dtype):
        v = _real(v)
        if isinstance(v, np.ndarray):
            t = self._copied(v, dtype)
            if t is not None:  # a copy of a constant or feed the forward pass took
                return self._ref(t, dtype)
        if not self.in_unit:  # NumPy values are data; inside tape.gradient, TF's shape constants
            return super()._ref(v, dtype)
        known = self._feeds.get(id(v)) or self._produced.get(id(v))
        if known is not None and known[0] is v:  # data the forward pass already fed or made
            return super()._ref(v, dtype)
        if isinstance(v, tfp.EagerTensorBase) and v.dtype.is_integer and \
                v.shape.num_elements() <= self.const_limit and id(v) not in self._born:
            # an integer tensor gradient code made invisibly (TF's caches): a shape constant,
            # fixed for a path (its feed shapes are part of the path's signature)
            return ConstRef(frozen_value(v.numpy(), v.dtype.name), v.dtype.name)
        if isinstance(v, tfp.EagerTensorBase):
            born = self._born.get(id(v))
            if born is not None and born[0] is v and isinstance(born[1], (np.ndarray, np.generic)) \
                    and born[1].size <= self.const_limit and v.dtype.name != "string":
                return ConstRef(frozen_value(born[1], v.dtype.name), v.dtype.name,
                                self._origin(v))
        elif isinstance(v, (np.ndarray, np.generic)) and v.size <= self.const_limit and \
                v.dtype.kind in "biuf":
            d = dtype or tf.as_dtype(v.dtype).name
            return ConstRef(frozen_value(v, d), d)
        return super()._ref(v, dtype)

    def shape_read(self, tensor) -> None:
        if not self.muted and not self.unit_depth:  # (a unit's reads: its shape checks)
            super().shape_read(tensor)

    def fetch(self, tensor, how: str) -> None:
        if self.muted:
            return
        ref = self.ref_of(tensor)
        if ref is not None:
            self.trace.fetches.append(Fetch(ref, len(self.trace.records), how,
                                            self.unit_depth > 0))
        if self.unit_reads is not None:
            real = _real(tensor)
            if ref is None:
                e = self._feeds.get(id(real))
                ref = e[1] if e is not None and e[0] is real else None
            if ref is not None:
                self.unit_reads.append((ref, np.array(real.numpy())))

    def ref_of(self, tensor):
        return super().ref_of(_real(tensor))

    def op(self, op_type, inputs, attrs, route, run):
        if route == "fast" and not self.too_long and (_reads_raw_variable(op_type, inputs) or (
                tfp.execute_module.must_record_gradient() and _has_raw_value(inputs))):
            # C++ would read the variable invisibly; the wrapper's slow path reads it in Python,
            # where the read is an op we record (and the tape sees the same value).
            self._fast_failed = op_type
            raise tfp.FallbackException()
        if self.too_long:
            return run()
        if len(self.trace.records) >= self.max_ops:
            self.too_long = True
            self.trace.unsupported.append(f"more than {self.max_ops} ops in one iteration")
            self.trace.first_unsupported = 0
            return run()
        return super().op(op_type, inputs, attrs, route, run)


def _has_raw_value(inputs) -> bool:
    """A Python or NumPy value the C fast path would convert invisibly (a tape keeps the
    converted tensor, and its gradient would read a tensor no record produced)."""
    for v in inputs:
        for e in (v if isinstance(v, (list, tuple)) else (v,)):
            if not isinstance(e, (tf.Tensor, tfp.BaseResourceVariable)) and \
                    not hasattr(e, "handle") and e is not None:
                return True
    return False


def _reads_raw_variable(op_type, inputs) -> bool:
    resource = _RESOURCE_ARGS.get(op_type, _UNSEEN)
    if resource is _UNSEEN:  # read once per op type: op_def fields are protobuf accesses
        op_def = tfp.get_op_def(op_type)
        resource = _RESOURCE_ARGS[op_type] = None if op_def is None else \
            tuple(arg.type == _DT_RESOURCE for arg in op_def.input_arg)
    if resource is None:
        return False
    for is_resource, v in zip(resource, inputs):
        if is_resource:
            continue
        for e in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(e, tfp.BaseResourceVariable):
                return True
    return False


_DT_RESOURCE = tf.resource.as_datatype_enum
_RESOURCE_ARGS: dict = {}  # op type -> whether each input arg is a resource (None: no op_def)
_UNSEEN = object()



def record(fn, *args, site: str | None = None, **kwargs):
    """Run `fn(*args, **kwargs)` once while recording; returns (result, recorder)."""
    rec = Recorder(site or getattr(fn, "__qualname__", "iteration"))
    rec.start(sys._getframe(0))
    try:
        result = fn(*args, **kwargs)
    finally:
        rec.stop()
    return result, rec
