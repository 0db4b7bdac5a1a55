"""The guards of Keras layer units (units.layer_call): what of a layer, and of every layer
inside it, must be the same for its call to be skipped whole.

- A built-in layer, loss or plain model of built-in layers: the plain Python values of their
  attributes.
- A user-defined layer or model, a unit where its Python only computed while traced
  (tracing/purity.py): the same for each layer in it, plus, for the user-defined ones,
  containers of plain values frozen and tensor attributes by identity; and, compared afresh
  every time, the containers the traced Python read (a list mutated in place changes no
  attribute).

Scanning every attribute of every layer per step costs more than the ops it guards (0.3 ms
for a two-block transformer), so the scan is kept while no layer attribute changes
(`hook.layer_epoch`, counted in Keras' `Layer.__setattr__`)."""
from __future__ import annotations

import types
import weakref
from typing import Optional

from terra import _tf_private as tfp
from terra.tracing import hook, purity

__all__ = ["builtin_settings", "user_settings", "read_containers", "forced_codes", "denied_codes",
           "impurity", "layers_of", "Verdict", "known_verdict", "remember_verdict"]

_cache: dict = {}
_cache_epoch = -1


def _cached(key, compute):
    """`compute()`, kept while no layer attribute changes (ids are safe as keys: a new layer
    sets attributes, which starts a new epoch)."""
    global _cache_epoch
    e = hook.layer_epoch()
    if e != _cache_epoch:
        _cache.clear()
        _cache_epoch = e
    hit = _cache.get(key)
    if hit is None:
        hit = _cache[key] = compute()
    return hit


def _builtin(obj) -> bool:
    module = type(obj).__module__
    return module.startswith(tfp.KERAS_BUILTIN_LAYER_MODULES + ("keras.src.ops.",)) or \
        module in tfp.KERAS_BUILTIN_MODEL_MODULES


def _plain(x) -> tuple:
    return tuple([(k, v) for k, v in vars(x).items()
                  if isinstance(v, purity.PLAIN) and k not in tfp.KERAS_LOOP_STATE])


# ------------------------------------------------------------------------------ built-in units
def builtin_settings(layer, model: bool):
    """The guard of a built-in layer's call (`model`: of a plain model of built-in layers),
    less its inputs; None if `layer` is a model that is not made of built-in layers only."""
    def compute():
        if not model:
            return _plain(layer)
        inner = tfp.keras_builtin_model_layers(layer)
        if inner is None:
            return False
        return (_plain(layer),) + tuple((id(x), _plain(x)) for x in inner)
    out = _cached(("builtin", id(layer)), compute)
    return None if out is False else out


# -------------------------------------------------------------------------- user-defined units
def layers_of(layer) -> list:
    """`layer`, every layer inside it and the `keras.ops` operations of a functional graph."""
    inner = list(layer._flatten_layers(include_self=True, recursive=True))
    seen = {id(x) for x in inner}
    return inner + [op for op in getattr(layer, "_operations", ()) if id(op) not in seen]


def _user_layer_settings(x) -> tuple:
    if _builtin(x):
        return _plain(x)
    out = purity.settings(x, tfp.KERAS_LOOP_STATE)
    tensors = tuple((k, id(v)) for k, v in vars(x).items() if isinstance(v, tfp.Tensor))
    return out + tensors if tensors else out


def _user_static(layer):
    layers = layers_of(layer)
    return (tuple((id(x), _user_layer_settings(x)) for x in layers),
            [weakref.ref(x) for x in layers])


def user_settings(layer, read=None) -> tuple:
    """The guard of a user-defined layer's call, less its inputs: its layers' settings, the
    `read` (layer index, attribute) pairs holding containers, and those containers frozen now.
    `read`: the pairs of the unit to compare with; None (tracing) takes them from `reads`."""
    static, refs = _cached(("user", id(layer)), lambda: _user_static(layer))
    if read is None:
        read = ()
    values = []
    for i, name in read:
        x = refs[i]() if i < len(refs) else None
        try:
            values.append(purity.freeze(vars(x)[name]) if x is not None else None)
        except (KeyError, TypeError):
            values.append(None)
    return (static, tuple(read), tuple(values))


def read_containers(layer, names) -> tuple:
    """(layer index, attribute) of each container of plain values among `names` held by a
    user-defined layer inside `layer` (what its traced Python may have read)."""
    out = []
    for i, x in enumerate(layers_of(layer)):
        if _builtin(x):
            continue
        for name in sorted(names):
            v = vars(x).get(name)
            if isinstance(v, (list, tuple, dict, set, frozenset)):
                try:
                    purity.freeze(v)
                except TypeError:
                    continue
                out.append((i, name))
    return tuple(out)


def forced_codes(layer) -> list:
    """The `call` code of every user-defined layer in `layer`: checked wherever it lives."""
    out = []
    for x in layers_of(layer):
        call = getattr(type(x), "call", None)
        if not _builtin(x) and isinstance(call, types.FunctionType):
            out.append(call.__code__)
    return out


def denied_codes() -> list:
    """Keras code whose effect a skipped call would lose, even where trusted code runs it: a
    loss added in the call (`model.losses` is read after it)."""
    layer = tfp.keras_unit_classes().get("layer")
    add_loss = getattr(layer, "add_loss", None)
    return [add_loss.__code__] if isinstance(add_loss, types.FunctionType) else []


def _inert(v) -> bool:
    """A value that needs no guard of its own: a layer (guarded itself), a variable (read by
    ops), a tensor (guarded by identity), a function, class or module, or an object of Keras or
    TF."""
    if isinstance(v, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type,
                      types.ModuleType, tfp.Tensor, tfp.BaseResourceVariable)):
        return True
    if isinstance(v, tfp.keras_unit_classes().get("layer", ())):  # guarded in `layers_of`
        return True
    return type(v).__module__.startswith(("keras.", "tensorflow.", "tf_keras."))


def impurity(w: purity.Watch, layer) -> Optional[str]:
    """Why the call of `layer` watched by `w` cannot be a unit, or None."""
    if w.reason is not None:
        return w.reason
    for x in layers_of(layer):
        if not _builtin(x):
            why = purity.unguarded_attribute(x, w.attributes, _inert)
            if why is not None:
                return why
    return None


# ------------------------------------------------------------------ purity verdicts, kept
class Verdict:
    """A watched call's verdict as `impurity` and `user_settings` read it (`reason`,
    `attributes`), kept for the next trace of the same call."""
    __slots__ = ("reason", "attributes", "read", "values")

    def __init__(self, reason, attributes, read, values):
        self.reason, self.attributes = reason, frozenset(attributes)
        self.read, self.values = read, values


_verdicts: dict = {}
_verdicts_epoch = -1
_MAX_VERDICTS = 4096


def _verdict_key(layer, settings, flat):
    def spec(x):
        if isinstance(x, (bool, int, float, str, type(None))):
            return ("value", type(x), x)
        if isinstance(x, tfp.BaseResourceVariable):
            return ("variable", id(x))
        shape = getattr(x, "shape", None)
        return ("spec", type(x), tuple(shape) if shape is not None else None,
                str(getattr(x, "dtype", None)))
    return (id(layer), settings) + tuple(spec(x) for x in flat)


def known_verdict(layer, settings, flat) -> Optional[Verdict]:
    """The verdict of an earlier traced call of `layer` with the same settings (layer epoch
    included), inputs of the same shapes and dtypes, and the same plain arguments, if the
    containers its Python read hold what they held then; else None.

    Watching a call costs a profile event per Python call and C call in it (about a third of a
    traced step of a model made of user-defined blocks). It need not be repeated: code found
    pure that read no tensor value runs the same way again on the same inputs' signatures and
    layer settings, so it is pure again and reads the same attributes. An impure verdict is
    kept on the same key (watching again would find the same code)."""
    if _verdicts_epoch != hook.layer_epoch():
        return None
    v = _verdicts.get(_verdict_key(layer, settings, flat))
    if v is None or user_settings(layer, v.read)[2] != v.values:
        return None
    return v


def remember_verdict(layer, settings, flat, watched: purity.Watch) -> None:
    """Keep `watched`'s verdict for `known_verdict` (the caller keeps only verdicts of calls
    that read no tensor value and were watched whole)."""
    global _verdicts_epoch
    e = hook.layer_epoch()
    if e != _verdicts_epoch or len(_verdicts) >= _MAX_VERDICTS:
        _verdicts.clear()
        _verdicts_epoch = e
    read = read_containers(layer, watched.attributes)
    _verdicts[_verdict_key(layer, settings, flat)] = Verdict(
        watched.reason, watched.attributes, read, user_settings(layer, read)[2])
