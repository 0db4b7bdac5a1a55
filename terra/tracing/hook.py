"""The dispatch hook: the one place that patches TensorFlow.

Once installed, every eager op reaches the active `Interceptor` *before* its inputs are converted,
through the four entry points TF dispatches on (the C fast path, `execute.quick_execute`,
`execute.execute`, `execute.execute_with_cancellation`), plus the places Python pulls values out of
tensors (fetch points), converts Python values to tensors, reads variable handles, and calls
concrete functions. The interceptor decides what an op does: `run()` executes it the normal way
(the recorder records the result); a skip-mode runtime may instead return placeholders.

Only the thread that called `activate` is intercepted. When nothing is active every patched entry
point costs one global load and an `is None` test before calling the original.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import numpy as np

from terra import _tf_private as tfp
from terra.tracing import purity

_get_ident = threading.get_ident

# Mutable hook state (module globals: the cheapest possible check on the hot path).
_active: "Interceptor | None" = None   # the interceptor of the running iteration
_thread: int | None = None             # the thread it runs on
_busy = False                          # inside interceptor code: nested calls pass straight through
_installs = 0                          # install() reference count
_originals: dict = {}                  # (owner, attr) -> original object

# Ops the garbage collector issues from a dead resource's `__del__` (a variable collected while a
# step runs, possibly one a previous program left behind): they belong to no step, so they run as
# eager runs them, are never recorded, and never make the step's trace uncompilable.
COLLECTOR_OPS = frozenset({"DestroyResourceOp"})


class Interceptor:
    """What the hook calls while active. Subclass and override; the defaults just execute.

    `op(op_type, inputs, attrs, route, run)`:
      - route "fast": `inputs` holds one unconverted Python value per op_def input arg (a list for
        list args), `attrs` the flat (name, value, ...) tuple of *non-inferred* attrs as given.
        `run()` may raise `tfp.FallbackException`; TF then retries the same op on route
        "fallback". A skip-mode runtime raises it itself to keep TF on the same route.
      - route "fallback": `inputs` is the flat list of converted tensors, `attrs` the full attrs
        (an empty tuple where TF passes None: ops whose wrapper has no attrs to give, such as
        LogicalAnd).
      - route "function": `op_type` is the function name, `inputs` its flat tensor inputs.
      Return what `run()` returns (a Tensor, a list of Tensors, or None) or a substitute.
    """

    def op(self, op_type: str, inputs, attrs: tuple, route: str, run: Callable[[], Any]) -> Any:
        return run()

    def fetch(self, tensor, how: str) -> None:
        """Python is about to materialize `tensor` (`how`: numpy, bool, float, ...)."""

    #: whether `shape_read` is called (a recorder's; skip mode reads shapes of eager values only)
    wants_shape_reads = False

    def shape_read(self, tensor) -> None:
        """Python reads eager `tensor`'s `shape` (free in eager; in a graph where the data sets
        it, a value that must be fetched)."""

    def converted(self, value, dtype, tensor) -> None:
        """`value` (Python or NumPy) became eager tensor `tensor` without running an op."""

    def value_copy(self, tensor, value) -> None:
        """`tensor_util.constant_value` gave NumPy `value`, a copy of eager `tensor` (TF's
        gradient code turns a forward op's inputs into constants so)."""

    def variable_handle(self, variable, handle) -> None:
        """Resource variable `variable` handed out its `handle` tensor."""

    def function(self, fn) -> None:
        """AtomicFunction `fn` is about to be called (its name is what `op` will see)."""


def _intercepting() -> bool:
    return _active is not None and not _busy and _get_ident() == _thread


def _dispatch(ic, op_type, inputs, attrs, route, run):
    global _busy
    _busy = True
    w = purity.suspend()  # Terra's bookkeeping is not the user's Python: unwatched
    try:
        if w is not None:
            return ic.op(op_type, inputs, attrs, route, lambda: purity.watched(w, run))
        return ic.op(op_type, inputs, attrs, route, run)
    finally:
        purity.resume(w)
        _busy = False


def _notify(method, *args):
    global _busy
    _busy = True
    w = purity.suspend()
    try:
        method(*args)
    finally:
        purity.resume(w)
        _busy = False


# ------------------------------------------------------------------------------ op entry points
_num_inputs_cache: dict = {}


def _num_inputs(op_type: str) -> int:
    n = _num_inputs_cache.get(op_type)
    if n is None:
        op_def = tfp.get_op_def(op_type)
        n = _num_inputs_cache[op_type] = len(op_def.input_arg) if op_def is not None else 0
    return n


def _wrap_fast_path(orig):
    def TFE_Py_FastPathExecute(ctx, op_name, name, *args):
        if _active is None or _busy or _get_ident() != _thread or op_name in COLLECTOR_OPS:
            return orig(ctx, op_name, name, *args)
        n = _num_inputs(op_name)
        return _dispatch(_active, op_name, args[:n], args[n:], "fast",
                         lambda: orig(ctx, op_name, name, *args))
    return TFE_Py_FastPathExecute


def _real_inputs(inputs):
    """What an op may really execute on: a placeholder (anything with `_terra_materialize`) that
    reaches eager execution, as it can when an op wrapper's fallback route converted arguments
    itself, is replaced by its value; handed to C++ as it is, it would crash the process.

    A list is changed in place: it is the op wrapper's own input list, which the wrapper then hands
    to `record_gradient`, so tapes record the op on the value (the tensor a fallback's replay made
    and recorded) rather than on the placeholder, whose id no recorded op produced."""
    if any(hasattr(x, "_terra_materialize") for x in inputs):
        real = [x._terra_materialize() if hasattr(x, "_terra_materialize") else x for x in inputs]
        if isinstance(inputs, list):
            inputs[:] = real
            return inputs
        return real
    return inputs


def _route(op_name: str) -> str:
    return "fallback" if tfp.get_op_def(op_name) is not None else "function"


def _wrap_execute(orig):
    def execute(op_name, num_outputs, inputs, attrs, ctx, name=None):
        if _active is None or _busy or _get_ident() != _thread:
            return orig(op_name, num_outputs, inputs, attrs, ctx, name)
        op_type = op_name.decode() if isinstance(op_name, bytes) else op_name
        if op_type in COLLECTOR_OPS:
            return orig(op_name, num_outputs, _real_inputs(inputs), attrs, ctx, name)
        return _dispatch(_active, op_type, inputs, attrs or (), _route(op_type),
                         lambda: orig(op_name, num_outputs, _real_inputs(inputs), attrs, ctx,
                                      name))
    return execute


def _wrap_execute_with_cancellation(orig):
    def execute_with_cancellation(op_name, num_outputs, inputs, attrs, ctx, cancellation_manager,
                                  name=None):
        if _active is None or _busy or _get_ident() != _thread:
            return orig(op_name, num_outputs, inputs, attrs, ctx, cancellation_manager, name)
        op_type = op_name.decode() if isinstance(op_name, bytes) else op_name
        if op_type in COLLECTOR_OPS:
            return orig(op_name, num_outputs, _real_inputs(inputs), attrs, ctx,
                        cancellation_manager, name)
        return _dispatch(_active, op_type, inputs, attrs or (), _route(op_type),
                         lambda: orig(op_name, num_outputs, _real_inputs(inputs), attrs, ctx,
                                      cancellation_manager, name))
    return execute_with_cancellation


def _wrap_call_flat(orig):
    def call_flat(self, *args):
        if _active is not None and not _busy and _get_ident() == _thread:
            _notify(_active.function, self)
        return orig(self, *args)
    return call_flat


# --------------------------------------------------------------------- values, handles, fetches
def _wrap_convert(orig):
    def convert_to_eager_tensor(value, ctx, dtype=None):
        t = orig(value, ctx, dtype)
        if _active is not None and not _busy and _get_ident() == _thread:
            _notify(_active.converted, value, dtype, t)
        return t
    return convert_to_eager_tensor


def _wrap_handle(orig):
    fget = orig.fget

    def handle(self):
        h = fget(self)
        if _active is not None and not _busy and _get_ident() == _thread:
            _notify(_active.variable_handle, self, h)
        return h
    return property(handle, doc=orig.__doc__)


def _wrap_shape(orig):
    """`EagerTensor.shape`, reported to a recorder: a trace then knows which shapes Python read,
    and a graph that leaves one of them open (a `tf.where`'s count, a ragged batch's width)
    fetches that value from its first build, where skip mode would otherwise fall back once per
    such read to learn it."""
    fget = orig.fget

    def shape(self):
        ic = _active
        if ic is not None and ic.wants_shape_reads and not _busy and _get_ident() == _thread:
            _notify(ic.shape_read, self)
        return fget(self)
    return property(shape, doc=orig.__doc__)


def _wrap_fetch(how):
    def factory(orig):
        def fetch_point(self, *args, **kwargs):
            global _busy
            if _active is None or _busy or _get_ident() != _thread:
                return orig(self, *args, **kwargs)
            _busy = True
            try:
                _active.fetch(self, how)
                return orig(self, *args, **kwargs)
            finally:
                _busy = False
        fetch_point.__name__ = getattr(orig, "__name__", how)
        return fetch_point
    return factory


def _wrap_constant_value(orig):
    def constant_value(tensor, partial=False):
        global _busy
        if hasattr(tensor, "_terra_materialize"):
            # a placeholder stands for an eager tensor, whose constant value eager reads (TF's
            # graph-only fallback, `try_evaluate_constant`, would ask it for a graph)
            tensor = tensor._terra_materialize()
        if _active is None or _busy or _get_ident() != _thread:
            return orig(tensor, partial)
        _busy = True
        try:
            if not isinstance(tensor, tfp.EagerTensorBase):
                return orig(tensor, partial)
            _active.fetch(tensor, "constant_value")
            value = orig(tensor, partial)
            if isinstance(value, np.ndarray):
                _active.value_copy(tensor, value)
            return value
        finally:
            _busy = False
    return constant_value


def _wrap_args_to_matching(orig):
    """Eager takes a list input's dtype from its first tensor (`tf.concat([[0], n])` with an
    int64 `n` is int64). TF looks only for eager tensors there, so where that tensor is a
    placeholder (skip mode, or one a fallback bound) the literal before it would set int32: skip
    mode would see another op than eager ran, and the fallback that follows would run it on
    mixed dtypes. A placeholder sets the dtype as the eager tensor it stands for would; and where
    every input is a tensor, nothing but the placeholders is converted, as TF converts none:
    a tensor of another dtype reaches the kernel, whose error is eager's (not a conversion's)."""
    def args_to_matching_eager(l, ctx, allowed_dtypes, default_dtype=None):
        for t in l:
            if isinstance(t, tfp.CoreValue):
                break
            if hasattr(t, "_terra_materialize"):
                dtype = t.dtype
                if all(isinstance(x, tfp.CoreValue) or hasattr(x, "_terra_materialize")
                       for x in l):
                    return dtype.as_datatype_enum, [
                        x if isinstance(x, tfp.CoreValue) else tfp.convert_registered(x, dtype)
                        for x in l]
                return dtype.as_datatype_enum, [tfp.convert_registered(x, dtype) for x in l]
        return orig(l, ctx, allowed_dtypes, default_dtype)
    return args_to_matching_eager


def _wrap_array_function(orig):
    """NumPy functions given an eager tensor (`np.squeeze(t)`, `np.argmax(t)`) read it through the
    buffer protocol, which calls no Python method of the tensor. While the hook is installed,
    eager tensors take part in NumPy's function dispatch (`__array_function__`, NEP 18) only to
    report those reads; NumPy's own implementation then runs, as for an ndarray. Operators stay
    as they are (no `__array_ufunc__`). `orig` is `_ABSENT`: TF defines none."""
    def __array_function__(self, func, types, args, kwargs):
        if _intercepting():
            for t in _tensors_in(args, kwargs):
                _notify(_active.fetch, t, "array")
        return func._implementation(*args, **kwargs)
    return __array_function__


def _tensors_in(args, kwargs):
    """Eager tensors among NumPy call arguments, and one level into lists and tuples."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, tfp.EagerTensorBase):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, tfp.EagerTensorBase):
                    yield x


# The patch table: (owner, attribute, wrapper factory). Order matters only for uninstall (reverse).
FETCH_METHODS = {"numpy": "numpy", "__array__": "array", "__bool__": "bool", "__float__": "float",
                 "__int__": "int", "__index__": "index", "__complex__": "complex",
                 "__format__": "format", "__str__": "str"}


# ------------------------------------------------------------------------- variable creation
# Every eager `tf.Variable` made while the hook is installed is handed to the listener the runtime
# sets (`on_variable`): it files the variable's role (where the program made it), so a path can
# be predicted over a metric or model made anew (runtime/roles.py).
_variable_listener: "Callable | None" = None


def on_variable(listener: "Callable | None") -> None:
    """`listener(variable)` receives every new eager resource variable from now on (None: none)."""
    global _variable_listener
    _variable_listener = listener


def _wrap_variable_init(orig):
    def _init_from_args(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        listener = _variable_listener
        if listener is not None and not _busy:
            listener(self)
    _init_from_args.__wrapped__ = orig
    return _init_from_args


# ------------------------------------------------------------------------- coarse-unit patches
# `optimizer.apply_gradients`, Keras layer calls and eager `tf.function` calls are matched as one
# guarded unit each. The patched methods hand the call to the unit router the runtime sets
# (`route_units`) with the unit's kind; with no router they call the original.
_unit_router: "Callable | None" = None


def route_units(router: "Callable | None") -> None:
    """`router(kind, original, obj, args, kwargs)` receives every unit call from now on (None:
    the originals run)."""
    global _unit_router
    _unit_router = router


def _wrap_unit(kind):
    def factory(orig):
        # AutoGraph converts what is not TF's own code; converting this wrapper (when converted
        # code calls a tf.function or a layer) loses its closure: keep it out, as TF's own is
        @_do_not_convert
        def unit_call(self, *args, **kwargs):
            router = _unit_router
            if router is None:
                return orig(self, *args, **kwargs)
            return router(kind, orig, self, args, kwargs)
        unit_call.__wrapped__ = orig
        unit_call.__name__ = getattr(orig, "__name__", kind)
        return unit_call
    return factory


def _wrap_api_unit(orig):
    """A composite TF API function (`tfp.API_UNIT_FUNCTIONS`) routed as a unit: the rule is
    handed the function itself as the unit's object."""
    def call_original(_fn, *args, **kwargs):
        return orig(*args, **kwargs)

    @_do_not_convert
    def api_call(*args, **kwargs):
        router = _unit_router
        if router is None:
            return orig(*args, **kwargs)
        return router("api", call_original, orig, args, kwargs)
    api_call.__wrapped__ = orig
    api_call.__name__ = getattr(orig, "__name__", "api_call")
    api_call.__doc__ = getattr(orig, "__doc__", None)
    return api_call


def _wrap_api_method(orig):
    """A tensor method that is such a composite (`tfp.API_UNIT_METHODS`): the tensor is the
    call's first argument."""
    def call_original(_fn, *args, **kwargs):
        return orig(*args, **kwargs)

    @_do_not_convert
    def api_method(self, *args, **kwargs):
        router = _unit_router
        if router is None:
            return orig(self, *args, **kwargs)
        return router("api", call_original, orig, (self,) + args, kwargs)
    api_method.__wrapped__ = orig
    api_method.__name__ = getattr(orig, "__name__", "api_method")
    api_method.__doc__ = getattr(orig, "__doc__", None)
    return api_method


_layer_epoch = 0


def layer_epoch() -> int:
    """A count of the changes made to Keras layers' attributes through `Layer.__setattr__` /
    `__delattr__` while the hook is installed, and of installs (a set to the value already
    there is no change: Keras sets `built` and `_called` on every call). Guards of layer units computed at one epoch hold while it lasts
    (runtime/layer_guards.py)."""
    return _layer_epoch


_SAME_IF_EQUAL = (bool, int, float, str, type(None))


def _wrap_layer_setattr(orig):
    def __setattr__(self, name, value):
        global _layer_epoch
        old = self.__dict__.get(name, _ABSENT)
        if old is not value and not (type(old) is type(value) and
                                     isinstance(value, _SAME_IF_EQUAL) and old == value):
            _layer_epoch += 1
        return orig(self, name, value)
    return __setattr__


def _wrap_layer_delattr(orig):
    def __delattr__(self, name):
        global _layer_epoch
        _layer_epoch += 1
        return orig(self, name)
    return __delattr__


def _do_not_convert(fn):
    import tensorflow as tf
    return tf.autograph.experimental.do_not_convert(fn)


def _unit_table():
    keras_classes = tfp.keras_unit_classes()
    table = [(tfp.PolymorphicFunction, "__call__", _wrap_unit("function"))]
    if "apply_gradients" in keras_classes:
        table.append((keras_classes["apply_gradients"], "apply_gradients",
                      _wrap_unit("apply_gradients")))
    if "layer" in keras_classes:
        table.append((keras_classes["layer"], "__call__", _wrap_unit("layer")))
        table.append((keras_classes["layer"], "__setattr__", _wrap_layer_setattr))
        table.append((keras_classes["layer"], "__delattr__", _wrap_layer_delattr))
    if "loss" in keras_classes:
        table.append((keras_classes["loss"], "__call__", _wrap_unit("loss")))
    table += [(owner, name, _wrap_unit("metric")) for owner, name in
              tfp.keras_metric_unit_methods()]
    table += [(owner, name, _wrap_api_unit) for owner, name in tfp.api_unit_functions()]
    table += [(owner, name, _wrap_api_method) for owner, name in tfp.api_unit_methods()]
    return table


# ----------------------------------------------------------------------------- gradient rules
# Registered gradient functions replaced while the hook is installed, keyed by op type: each
# gives eager's values and keeps the forward op's own input tensors where TF's makes copies.
GRADIENT_RULES = {"StridedSlice": tfp.strided_slice_gradient}
_GRADIENT_ENTRIES = {op_type: tfp.GradientEntry(op_type) for op_type in GRADIENT_RULES}


def _patch_table():
    table = [(tfp.pywrap_tfe_module, tfp.FAST_PATH_ATTR, _wrap_fast_path),
             (tfp.execute_module, "quick_execute", _wrap_execute),
             (tfp.execute_module, "execute", _wrap_execute),
             (tfp.execute_module, "execute_with_cancellation", _wrap_execute_with_cancellation),
             (tfp.AtomicFunction, "call_flat", _wrap_call_flat),
             (tfp.constant_op_module, tfp.CONVERT_ATTR, _wrap_convert),
             (tfp.tensor_util_module, tfp.CONSTANT_VALUE_ATTR, _wrap_constant_value),
             (tfp.execute_module, tfp.MATCHING_ATTR, _wrap_args_to_matching),
             (tfp.BaseResourceVariable, "handle", _wrap_handle),
             (tfp.ResourceVariable, tfp.VARIABLE_INIT_ATTR, _wrap_variable_init)]
    table += [(tfp.EagerTensorBase, m, _wrap_fetch(how)) for m, how in FETCH_METHODS.items()]
    table.append((tfp.EagerTensorBase, "__array_function__", _wrap_array_function))
    table.append((tfp.EagerTensorBase, "shape", _wrap_shape))
    table += [(_GRADIENT_ENTRIES[t], "fn", rule) for t, rule in GRADIENT_RULES.items()]
    return table + _unit_table()


# What `_raw` gives for an attribute a class does not define (install adds it, uninstall deletes it).
_ABSENT = object()


def _raw(owner, attr):
    """The attribute as stored (a property object rather than its value for classes)."""
    if isinstance(owner, type):
        return owner.__dict__.get(attr, _ABSENT)
    return getattr(owner, attr)


def patched_attributes() -> list:
    """(owner, attribute) of everything `install` replaces."""
    return [(owner, attr) for owner, attr, _ in _patch_table()]


def install() -> None:
    """Patch TF (reference counted: nested installs are cheap, the last uninstall restores)."""
    global _installs, _layer_epoch
    _installs += 1
    if _installs > 1:
        return
    _layer_epoch += 1  # changes made while uninstalled went uncounted
    for owner, attr, factory in _patch_table():
        orig = _raw(owner, attr)
        _originals[(owner, attr)] = orig
        setattr(owner, attr, factory(orig))


def uninstall() -> None:
    """Undo one `install`; the last one puts every original object back."""
    global _installs
    if _installs == 0:
        raise RuntimeError("terra hook: uninstall() without install()")
    _installs -= 1
    if _installs:
        return
    if _active is not None:
        raise RuntimeError("terra hook: uninstall() while an interceptor is active")
    for owner, attr in reversed(list(_originals)):  # what install replaced, newest first
        orig = _originals.pop((owner, attr))
        if orig is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, orig)


def installed() -> bool:
    return _installs > 0


def active() -> "Interceptor | None":
    """The interceptor active on the calling thread, if any."""
    return _active if _get_ident() == _thread else None


def activate(interceptor: Interceptor) -> tuple:
    """Route this thread's ops to `interceptor`; returns a token for `deactivate`."""
    global _active, _thread
    if not isinstance(interceptor, Interceptor):
        raise TypeError(f"terra hook: expected an Interceptor, got {interceptor!r}")
    if not _installs:
        raise RuntimeError("terra hook: activate() before install()")
    if _active is not None and _thread != _get_ident():
        raise RuntimeError("terra hook: another thread is already being intercepted")
    token = (_active, _thread)
    _active, _thread = interceptor, _get_ident()
    return token


def set_active(interceptor: "Interceptor | None") -> None:
    """Route the calling thread's ops to `interceptor` (None: nobody)."""
    deactivate((interceptor, _get_ident() if interceptor is not None else None))


def deactivate(token: tuple) -> None:
    global _active, _thread
    _active, _thread = token


@contextlib.contextmanager
def intercepting(interceptor: Interceptor):
    """`with intercepting(ic):` installs the hook, routes this thread's ops to `ic`, undoes both."""
    install()
    try:
        token = activate(interceptor)
        try:
            yield interceptor
        finally:
            deactivate(token)
    finally:
        uninstall()


# ------------------------------------------------------------------ tf.GradientTape (enable)
# `terra.enable()` makes every tape the program opens a Terra tape by rebinding the public name in
# each TF API module that exports it (`tf.GradientTape`, `tf.autodiff.GradientTape`,
# `tf.compat.v2.GradientTape`, ...). Libraries look the name up when they open a tape (Keras'
# trainer: `with tf.GradientTape() as tape`), so they get Terra's tape too. TF's internal modules
# keep the plain class. Kept apart from `install`: the dispatch patches live only while Terra runs
# an iteration; this one lives from `enable()` to `disable()`.
_tape_originals: dict = {}   # (owner, attr) -> what it held before `replace_gradient_tape`


def _wrap_boundary(orig, boundary):
    """Keras' `fit` / `evaluate` / `predict`: the open iteration ends when one begins and when it
    returns, so one call's work (validation, the code after `fit`) is never part of an iteration
    of another."""
    @functools.wraps(orig)
    def keras_boundary(self, *args, **kwargs):
        boundary()
        try:
            return orig(self, *args, **kwargs)
        finally:
            boundary()
    keras_boundary.__terra_original__ = orig
    return keras_boundary


_keras_boundary: "Callable[[], None] | None" = None   # set while Keras' trainer awaits its patch


def replace_gradient_tape(cls, boundary: Callable[[], None]) -> None:
    """Rebind every public `GradientTape` export to `cls` (a subclass of TF's tape), and make
    Keras' trainer entry points call `boundary` (ends the open iteration) on entry and exit: now
    if Keras' trainer is imported, else once it is (Keras is not imported for it)."""
    global _keras_boundary
    if not (isinstance(cls, type) and issubclass(cls, tfp.PlainGradientTape)):
        raise TypeError(f"terra hook: {cls!r} is not a tf.GradientTape subclass")
    if _tape_originals:
        return
    for owner, attr in tfp.gradient_tape_exports():
        _tape_originals[(owner, attr)] = getattr(owner, attr)
        setattr(owner, attr, cls)
    _keras_boundary = boundary
    from terra import env_hook
    env_hook.after_import(tfp.KERAS_TRAINER_MODULE, patch_keras_trainer)


def patch_keras_trainer() -> None:
    """Wrap Keras' trainer entry points, if Terra is still enabled and they are not yet wrapped
    (called after Keras' trainer module is imported, and by a Terra tape's first `__enter__`,
    in case that module was mid-import when Terra was enabled)."""
    global _keras_boundary
    boundary = _keras_boundary
    if boundary is None or not _tape_originals:
        return
    trainer = tfp.keras_trainer_class(import_it=False)
    if trainer is None:
        return
    _keras_boundary = None
    for attr in tfp.KERAS_TRAINER_BOUNDARIES:
        orig = trainer.__dict__[attr]
        _tape_originals[(trainer, attr)] = orig
        setattr(trainer, attr, _wrap_boundary(orig, boundary))


def keras_patch_pending() -> bool:
    return _keras_boundary is not None


def restore_gradient_tape() -> None:
    """Put back everything `replace_gradient_tape` replaced (TF's own class, Keras' methods)."""
    global _keras_boundary
    _keras_boundary = None
    while _tape_originals:
        (owner, attr), orig = _tape_originals.popitem()
        setattr(owner, attr, orig)


def gradient_tape_replaced() -> bool:
    return bool(_tape_originals)


def replaced_attributes() -> list:
    """(owner, attribute) of everything `replace_gradient_tape` replaced."""
    return list(_tape_originals)
