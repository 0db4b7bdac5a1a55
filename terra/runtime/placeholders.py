"""Placeholders: what the PythonRunner hands to user code instead of real tensors.

A `Placeholder` stands for the output of an op that the graph computes. It is a real
`tf.Tensor` subclass (built with `object.__new__`, no graph behind it), so user code, TF and Keras
accept it wherever a tensor goes. Its value lives behind a *resolver*: any object with
`.resolve() -> EagerTensor` (later the runtime's fetch from the running graph).

Where the value is needed it is materialized through the resolver, once, and cached:
- conversion (`tf.convert_to_tensor`, every op wrapper's input conversion) goes through
  `__tf_tensor__`, so an op that receives a placeholder receives the real value (until the runtime
  intercepts those ops itself);
- `numpy()`, `__array__`, `__float__`, `__int__`, `__index__`, `__bool__`, `__len__`, `__format__`,
  `__repr__`/`__str__` are Python sync points: they fetch. So is `shape` where the placeholder's
  static shape is not fully known (the graph does not fix it for every value of its feeds).

After a fallback the runtime re-binds a placeholder to its real EagerTensor (`_terra_bind`): user
code keeps placeholders in lists and attributes across iterations, and from then on every attribute,
conversion and sync point forwards to the bound tensor.
"""
import itertools

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp

__all__ = ["Placeholder", "ConstantResolver", "is_placeholder"]

_ids = itertools.count()

# static shapes and dtypes by their recorded form: a skip-mode step makes placeholders of the
# same few shapes every iteration, and building a TensorShape costs more than the rest of
# `create` (TensorShape and DType are immutable, so one object serves every placeholder)
_SHAPES: dict = {}
_DTYPES: dict = {}


def _static_shape(shape):
    if type(shape) is _TensorShape:  # (a lookup would compare it with an equal tuple's key,
        return shape                 # converting the tuple on every call)
    key = tuple(shape) if isinstance(shape, list) else shape
    try:
        s = _SHAPES.get(key)
    except TypeError:  # an unhashable form: build it
        return tf.TensorShape(shape)
    if s is None:
        if len(_SHAPES) > 4096:
            _SHAPES.clear()
        s = _SHAPES[key] = tf.TensorShape(shape)
    return s


_TensorShape = tf.TensorShape


def _dtype(dtype):
    d = _DTYPES.get(dtype)
    if d is None:
        d = _DTYPES[dtype] = tf.dtypes.as_dtype(dtype)
    return d


class _DummyOp:
    """Stand-in for `Tensor.op`; its `type` matches no real op (Keras reads `output.op.type`)."""

    __slots__ = ("name",)
    type = "TerraPlaceholder"
    inputs = ()
    control_inputs = ()
    graph = None
    device = ""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<TerraPlaceholder op {self.name}>"


class ConstantResolver:
    """Resolver returning a value it already holds (tests; values known on the Python side)."""

    __slots__ = ("value", "calls")

    def __init__(self, value):
        self.value = tf.convert_to_tensor(value)
        self.calls = 0

    def resolve(self):
        self.calls += 1
        return self.value


_guards_installed = False


def _install_guards():
    global _guards_installed
    tfp.install_function_call_guard(Placeholder, _materialize)
    tfp.install_tensor_array_index_guard(Placeholder)
    _guards_installed = True


def _check_resolver(resolver):
    if not callable(getattr(resolver, "resolve", None)):
        raise TypeError(f"resolver must have a callable .resolve(), got {resolver!r}")


class Placeholder(tfp.Tensor):
    """A `tf.Tensor` whose value is produced elsewhere and fetched on demand.

    Create with `Placeholder.create(dtype, shape, resolver, terra_id=None)`, not the constructor
    (the base constructor wants a graph op).
    """

    _USE_EQUALITY = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__name__ = _EAGER_TYPE_NAME  # see the note at the end of this module

    @classmethod
    def create(cls, dtype, shape, resolver, terra_id=None):
        _check_resolver(resolver)
        if not _guards_installed:
            _install_guards()
        self = object.__new__(cls)
        d = self.__dict__
        d["_dtype"] = _dtype(dtype)
        d["_shape_val"] = _static_shape(shape)
        d["_id"] = tfp.new_tensor_uid()
        d["_terra_id"] = next(_ids) if terra_id is None else terra_id
        d["_name"] = f"terra_placeholder_{d['_terra_id']}"
        d["_op"] = _DummyOp(d["_name"])
        d["_terra_resolver"] = resolver
        d["_terra_value"] = None
        d["_terra_bound"] = False
        return self

    def __init__(self, *args, **kwargs):
        raise TypeError("build placeholders with Placeholder.create(dtype, shape, resolver)")

    # ---- identity and static metadata -------------------------------------------------------
    @property
    def terra_id(self):
        return self._terra_id

    @property
    def op(self):
        return self._op

    @property
    def value_index(self):
        return 0

    @property
    def shape(self):
        # an eager tensor's shape is always fully known: a dimension the graph does not fix
        # (it depends on a value: `tf.range(n)`) is a Python sync point, like `numpy()`
        v = self._terra_value
        if v is None and not self._shape_val.is_fully_defined():
            v = self._terra_materialize()
        return v.shape if v is not None else self._shape_val

    def get_shape(self):
        return self.shape

    def set_shape(self, shape):
        if not self.shape.is_compatible_with(shape):
            raise ValueError(f"shape {shape} is incompatible with {self.shape} of {self._name}")
        self.__dict__["_shape_val"] = self._shape_val.merge_with(shape)

    def _datatype_enum(self):
        # read by TF's eager fallback (`convert_to_mixed_eager_tensors`) from converted inputs
        return self._dtype.as_datatype_enum

    @property
    def device(self):
        v = self._terra_value
        return v.device if v is not None else ""

    # No `graph` attribute: like an EagerTensor's, it raises AttributeError (tf.Variable's
    # initializer check reads `initial_value.graph` only when `hasattr` finds it).

    @property
    def is_materialized(self):
        """True once the value was fetched or bound (no further fetch will happen)."""
        return self._terra_value is not None

    @property
    def is_bound(self):
        """True once `_terra_bind` made this placeholder a forwarder to a real tensor."""
        return self._terra_bound

    # ---- value -------------------------------------------------------------------------------
    def _check_value(self, value, where):
        if not isinstance(value, tfp.EagerTensor):
            raise TypeError(
                f"{where} for {self._name} must give an EagerTensor, got {type(value)!r}")
        if value.dtype != self._dtype:
            raise TypeError(f"{where} for {self._name} gave dtype {value.dtype.name}, "
                            f"expected {self._dtype.name}")
        if not self._shape_val.is_compatible_with(value.shape):
            raise ValueError(f"{where} for {self._name} gave shape {value.shape}, "
                             f"expected {self._shape_val}")

    def _terra_materialize(self):
        """The real value: fetched through the resolver on first use, then cached."""
        v = self._terra_value
        if v is None:
            v = self._terra_resolver.resolve()
            self._check_value(v, "resolver")
            self.__dict__["_terra_value"] = v
        return v

    def _terra_read(self):
        """The real value for a Python read (a sync point). A value skip mode computed eagerly
        as well (an eager twin, python_runner.py) is there already; the read is still logged as
        one, once, for a fallback later in the iteration to hand to its trace."""
        on_read = self.__dict__.pop("_terra_on_read", None)
        if on_read is not None:
            on_read()
        return self._terra_materialize()

    def _terra_bind(self, value):
        """Turn this placeholder into a forwarder to `value` (after a fallback)."""
        self._check_value(value, "_terra_bind")
        d = self.__dict__
        d["_terra_value"] = value
        d["_terra_bound"] = True
        d["_terra_resolver"] = None

    def _terra_rebind_resolver(self, resolver):
        """Point an unmaterialized placeholder at another resolver (a new run of the graph)."""
        _check_resolver(resolver)
        if self._terra_value is not None:
            raise ValueError(f"{self._name} already has a value; cannot change its resolver")
        self.__dict__["_terra_resolver"] = resolver

    def __tf_tensor__(self, dtype=None, name=None):
        v = self._terra_materialize()
        if dtype is not None and not tf.dtypes.as_dtype(dtype).is_compatible_with(v.dtype):
            raise ValueError(f"Tensor conversion requested dtype {tf.dtypes.as_dtype(dtype).name} "
                             f"for {self._name} with dtype {v.dtype.name}")
        return v

    # ---- Python sync points (fetch) ------------------------------------------------------------
    def numpy(self):
        return self._terra_read().numpy()

    def __array__(self, dtype=None, copy=None):
        a = self._terra_read().numpy()
        return np.asarray(a, dtype=dtype) if copy is None else np.array(a, dtype=dtype, copy=copy)

    def __float__(self):
        return float(self._terra_read())

    def __int__(self):
        return int(self._terra_read())

    def __index__(self):
        return self._terra_read().__index__()

    def __bool__(self):
        return bool(self._terra_read())

    def __len__(self):
        return len(self._terra_read())

    def __format__(self, format_spec):
        return format(self._terra_read(), format_spec)

    def __repr__(self):
        return repr(self._terra_read())

    def __str__(self):
        return str(self._terra_read())

    def __iter__(self):
        if self._shape_val.rank is None or self._shape_val[0] is None or self.is_materialized:
            return iter(self._terra_read())
        return super().__iter__()

    def __hash__(self):
        raise TypeError("Tensor is unhashable. Instead, use tensor.ref() as the key.")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (tf.convert_to_tensor, (self._terra_read().numpy(),))

    # ---- forwarding ----------------------------------------------------------------------------
    def __getattr__(self, name):
        # Only called for attributes the class does not define.
        v = self.__dict__.get("_terra_value")
        if v is not None and not name.startswith("__"):
            return getattr(v, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

    def __setattr__(self, name, value):
        # Keras and TF set private attributes on tensors (e.g. `_keras_mask`); keep them on the
        # placeholder itself so they survive a re-bind.
        self.__dict__[name] = value


# Python names an object's type in its own errors (`x[0] = 1`: "'...' object does not support
# item assignment") by the type's `__name__`. A placeholder stands for an eager tensor, so the
# program must read what eager says; `__qualname__` (in `repr(type(x))`) keeps the real name.
_EAGER_TYPE_NAME = f"{tfp.EagerTensor.__module__}.{tfp.EagerTensor.__name__}"
Placeholder.__name__ = _EAGER_TYPE_NAME


def is_placeholder(x):
    return isinstance(x, Placeholder)


def _materialize(ph):
    return ph._terra_materialize()
