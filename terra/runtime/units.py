"""Coarse units: `tape.gradient`, `optimizer.apply_gradients`, Keras layer calls and eager
`tf.function` calls, each matched as one guarded call (recorded while tracing, skipped whole in
co-execution). `UNIT_RULES` maps the hook's unit kinds to them."""
from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.config import CONFIG
from terra.runtime.mode import Mode, ON_PATH
from terra.ir.op_kinds import UNSEEDED_RANDOM_OPS
from terra.ir.records import ConstRef, FeedRef, OutputRef, VariableRef
from terra.runtime.placeholders import Placeholder
from terra.runtime.divergence import PAST_END, Diverged, Divergence, DivergenceKind, user_line
from terra.runtime.path_view import GradUnit
from terra.runtime.python_runner import placeholder_ref
from terra.runtime import layer_guards
from terra.tracing import hook, purity
from terra.tracing.locations import pause_tracking, resume_tracking


def guard_ref(session, it, x):
    if x is None:
        return None
    if it.mode == Mode.SKIP:
        r = placeholder_ref(x, it.runner)
        if r is not None:
            return r
        if isinstance(x, Placeholder):
            x = x._terra_materialize()
        v = _var_ref(x)
        if v is not None:
            return v
        for slot, oid in it.runner.fed_ids.items():
            if oid == id(x):
                return FeedRef(slot)
        return ("external", id(x))
    rec = it.recorder
    r = rec.ref_of(x)
    if r is not None:
        return r
    v = _var_ref(x)
    if v is not None:
        return v
    if isinstance(x, Placeholder):
        x = x._terra_materialize()
    r = rec.feed_ref(x)
    return r if r is not None else ("external", id(x))

def variable_guards(session, it, xs) -> tuple:
    """`guard_ref` of each of `xs` in skip mode, kept per list of variable objects (the sources
    of `tape.gradient`, the variables of `apply_gradients`: guarding 100 variables one by one
    cost 0.4 ms a step). The cache holds the variables (their ids stay theirs) and the handle
    owners the guard noted for the runner (`PythonRunner.handles`); other lists are guarded
    afresh."""
    key = tuple(map(id, xs))
    hit = session.variable_guards.get(key)
    runner = it.runner
    if hit is not None:
        runner.handles.update(hit[2])
        return hit[1]
    refs = tuple(guard_ref(session, it, x) for x in xs)
    if all(type(r) is VariableRef for r in refs):
        if len(session.variable_guards) >= 32:
            session.variable_guards.clear()
        noted = {r.key: runner.handles[r.key] for r in refs if r.key in runner.handles}
        session.variable_guards[key] = (list(xs), refs, noted)
    return refs


def gradient(session, tape, target, sources, output_gradients, unconnected_gradients):
    base = tfp.PlainGradientTape.gradient
    it = session.iteration
    if it is None or it.mode not in ON_PATH or tape not in it.tapes or \
            session.foreign():
        return base(tape, real_values(target), real_values(sources), real_values(output_gradients),
                    unconnected_gradients)
    flat_args = (tf.nest.flatten(target) + ["|"] + tf.nest.flatten(sources) + ["|"] +
                 tf.nest.flatten(output_gradients) + ["|"] + list(tape._terra_watched))
    if it.mode == Mode.SKIP:
        n = len(tf.nest.flatten(target)) + 1
        m = n + len(tf.nest.flatten(sources))
        guard = tuple(a if isinstance(a, str) else guard_ref(session, it, a)
                      for a in flat_args[:n]) + \
            variable_guards(session, it, flat_args[n:m]) + \
            tuple(a if isinstance(a, str) else guard_ref(session, it, a)
                  for a in flat_args[m:]) + \
            (str(unconnected_gradients), tape._watch_accessed_variables)
        try:
            with session.internal():
                flat = it.runner.gradient_unit(guard)
                unit = it.runner.last_unit
            if tfp.gradient_taken(tape):
                it.tape_exited(tape)  # eager's tape stops here (a gradient inside its `with`)
            if unit.pack is not None:
                return _pack_gradients(unit.pack, flat)
            if unit.structure is not None:
                return tf.nest.pack_sequence_as(unit.structure, flat, expand_composites=True)
            return tf.nest.pack_sequence_as(sources, flat)
        except Diverged as d:
            it.fallback(d.divergence)
    rec = it.recorder
    target, sources, output_gradients = (real_values(target), real_values(sources),
                                         real_values(output_gradients))
    guard = tuple(a if isinstance(a, str) else guard_ref(session, it, a) for a in flat_args) + \
        (str(unconnected_gradients), tape._watch_accessed_variables)
    start = len(rec.trace.records)
    born = rec.born_ids()
    with _unit_python(rec, tf_constants=True) as reads:
        result = base(tape, target, sources, output_gradients, unconnected_gradients)
    end = len(rec.trace.records)
    with _terra_reads(it):
        flat = tf.nest.flatten(result, expand_composites=True)
        composite = len(flat) != len(tf.nest.flatten(result))
        structure = _shape_of(result) if composite else None
    refs = []
    usable = not any(isinstance(g, tuple) for g in guard[:-2] if g is not None)
    for g in flat:
        if g is None:
            refs.append(None)
            continue
        r = None
        if isinstance(g, tfp.EagerTensorBase):
            r = rec.ref_of(g)
            if r is None and id(g) not in born:
                r = _shape_constant(g, rec.born_value(g))
        if r is None:
            usable = False
        refs.append(r)
    if usable and not rec.too_long:
        rec.units[start] = GradUnit(start, end, guard, tuple(refs), structure=structure,
                                    reads=tuple(reads), pack=_gradient_plan(result))
    return result


def _pack_results(structure, flat):
    """`tf.nest.pack_sequence_as(structure, flat, expand_composites=True)` where `structure`
    (a unit's results as TypeSpecs, `_shape_of`) is one TensorSpec or a plain list or tuple of
    them, as most units' results are, without walking it; anything else through `tf.nest`."""
    t = type(structure)
    if t is _TensorSpec:
        return flat[0]
    if structure is None and not flat:  # a unit without results (a metric's update)
        return None
    if (t is list or t is tuple) and len(structure) == len(flat) and \
            all(type(s) is _TensorSpec for s in structure):
        return t(flat)
    return tf.nest.pack_sequence_as(structure, flat, expand_composites=True)


_TensorSpec = tf.TensorSpec


def _gradient_plan(result):
    """How a gradient list's flat results pack back (`_pack_gradients`): per element, 0 for a
    tensor or None, 2 or 3 for an `IndexedSlices` (values, indices[, dense shape]); None for any
    other structure (packed by `tf.nest`)."""
    if type(result) is not list:
        return None
    plan = []
    for g in result:
        if type(g) is tf.IndexedSlices:
            plan.append(2 if g.dense_shape is None else 3)
        elif g is None or isinstance(g, tfp.EagerTensorBase):
            plan.append(0)
        else:
            return None
    return tuple(plan)


def _pack_gradients(plan, flat) -> list:
    """`tf.nest.pack_sequence_as(structure, flat, expand_composites=True)` for a gradient list
    (`_gradient_plan`), without rebuilding each `IndexedSlices` through its TypeSpec."""
    out, i = [], 0
    for k in plan:
        if k:
            out.append(tf.IndexedSlices(flat[i], flat[i + 1], flat[i + 2] if k == 3 else None))
            i += k
        else:
            out.append(flat[i])
            i += 1
    return out


def _flat_gradients(grads) -> list:
    """`tf.nest.flatten(grads, expand_composites=True)` for tensors, None and `IndexedSlices`
    (what `apply_gradients` is given) without building each slice's TypeSpec, which reads its
    dense shape (a `constant_value`, per slice and step); anything else through `tf.nest`."""
    out = []
    for g in grads:
        if type(g) is tf.IndexedSlices:
            out.append(g.values)
            out.append(g.indices)
            if g.dense_shape is not None:
                out.append(g.dense_shape)
        elif g is None or isinstance(g, tfp.Tensor) and \
                not isinstance(g, tf.__internal__.CompositeTensor):
            out.append(g)
        else:
            return tf.nest.flatten(list(grads), expand_composites=True)
    return out

def _shape_constant(tensor, value):
    """A gradient's result that TF's gradient code made from a Python value (an
    `IndexedSlices`' dense shape: the variable's static shape) as a ConstRef; None for any
    other tensor. Skip mode returns that constant: the unit's guard fixes the sources, whose
    static shapes it was made from."""
    if value is None or tensor.dtype not in (tf.int32, tf.int64) or tensor.shape.rank > 1 or \
            tensor.shape.num_elements() > 8:
        return None
    return ConstRef(tuple(int(x) for x in np.asarray(tensor).reshape(-1)) if tensor.shape.rank
                    else int(tensor), tensor.dtype.name)


def apply_gradients(session, opt, original, grads_and_vars):
    """`optimizer.apply_gradients` as one coarse unit (guarded on the optimizer object, its
    plain Python settings, whether a tape records, the gradients' producers and the
    variables)."""
    it = session.iteration
    pairs = list(grads_and_vars)
    if it is None or it.mode not in ON_PATH or not getattr(opt, "built", False):
        return original(opt, pairs)
    settings = (tfp.tapes_recording(),) + tuple(
        (k, v) for k, v in vars(opt).items() if isinstance(v, (bool, int, float, str, type(None))))
    with _terra_reads(it):
        flat = _flat_gradients([g for g, _ in pairs]) + ["|"] + [v for _, v in pairs]
    if it.mode == Mode.SKIP and it.runner.view.units.get(it.runner.pos) is None and \
            it.runner.pos < it.runner.view.n:
        # no unit here (a sparse update's row filter has a length set by the data:
        # `sites.units_for`): its ops are matched one by one, their constants checked
        return original(opt, pairs)
    if it.mode == Mode.SKIP:
        n = len(flat) - len(pairs) - 1  # the "|" before the variables
        guard = (id(opt), settings) + tuple(
            x if isinstance(x, str) else guard_ref(session, it, x) for x in flat[:n + 1]) + \
            variable_guards(session, it, flat[n + 1:])
        try:
            with session.internal():
                it.runner.gradient_unit(guard)
            return opt.iterations
        except Diverged as d:
            it.fallback(d.divergence)
    rec = it.recorder
    with _terra_reads(it):
        pairs = [(real_values(g), v) for g, v in pairs]
        flat = [x._terra_materialize() if isinstance(x, Placeholder) else x for x in flat]
    guard = (id(opt), settings) + tuple(
        x if isinstance(x, str) else guard_ref(session, it, x) for x in flat)
    start = len(rec.trace.records)
    with _unit_python(rec, tf_constants=True) as reads:
        result = original(opt, pairs)
    usable = not any(isinstance(g, tuple) for g in guard[2:] if g is not None)
    if usable and not rec.too_long:
        rec.units[start] = GradUnit(start, len(rec.trace.records), guard, (),
                                    reads=tuple(reads))
    return result

def _data_feed(rec, x):
    """The feed a NumPy array passed straight to a unit became inside it (its conversion's
    feed holds the array itself), or None."""
    if isinstance(x, np.ndarray):
        for slot, v in enumerate(rec.trace.feed_values):
            if v is x:
                return FeedRef(slot)
    return None


def _feed_data_inputs(runner, want, guard, flat) -> tuple:
    """`guard` with each tensor the unit `want`s as a feed its model call first uses (data
    passed straight to the model) fed now, as tracing made it a feed inside the call; None if
    one cannot be (a batch of another shape: the model's ops, matched one by one, meet it)."""
    out = list(guard)
    mark = len(runner.fed_order)
    recorded = runner.iteration.path.trace.feed_values
    for i, x in enumerate(flat):
        w = want[i + 2]
        if isinstance(x, Placeholder) and isinstance(guard[i + 2], tuple):
            x = x._terra_materialize()  # an earlier iteration's (the batch sliced after its
            # tape: an eager twin), an external value now, as `PythonRunner._match` takes it
        if isinstance(guard[i + 2], tuple) and isinstance(w, FeedRef) and \
                isinstance(x, (tfp.EagerTensorBase, np.ndarray)) and w.slot not in runner.fed:
            value = x
            spec = runner.view.feed_specs[w.slot]
            if isinstance(x, np.ndarray) and x.dtype.name != spec.dtype and \
                    isinstance(recorded[w.slot], np.ndarray) and recorded[w.slot].dtype == x.dtype:
                # an array of the dtype traced, which the unit's Python converted to the feed's
                # dtype (a Keras loss converts integer labels to its float dtype): convert it so
                value = tf.convert_to_tensor(x, spec.dtype)
            try:
                runner.feed(w.slot, x, value)
            except Diverged as d:
                runner.rollback(mark)
                runner.data_divergence = d.divergence
                return None
            out[i + 2] = w
    return tuple(out)


def _switch_for_data(runner, unit) -> bool:
    """After data handed to `unit` diverged on its signature (a batch of another length than
    the path was traced with): switch to a compiled path traced with that signature whose unit
    here is the same call, where the unit is skipped whole, instead of matching the call's ops
    one by one on this path until the first of them switches anyway."""
    d, runner.data_divergence = runner.data_divergence, None
    if d is None or runner.new_feed is None:
        return False
    slot, dtype, shape = runner.new_feed
    pos = runner.pos

    def accepts(q):
        u = q.view.units.get(pos)
        specs = q.view.feed_specs
        return u is not None and u.guard[:2] == unit.guard[:2] and slot < len(specs) and \
            specs[slot].dtype == dtype and specs[slot].shape is not None and \
            tuple(specs[slot].shape) == tuple(shape)
    return runner.iteration.switch(d, tried={id(runner.iteration.path)}, accepts=accepts)


def _enter_traced(it, d: Divergence, accepts, loose=None) -> bool:
    """A unit's call whose first op would leave the path: a model called where its path ends
    while another path of the site goes on from there (a GAN's generator step after its last
    critic step), or data of another signature than the unit was traced with, where no path
    traced with that signature has this call as a unit (`_switch_for_data`). Switch now to a
    compiled path that `accepts` what comes, or else to one that `loose` accepts (True: the
    caller calls again, on that path), or else fall back before the call (False: it is then
    traced whole, as one unit). Left to its
    first op, the fallback came inside the call, the trace held the layers as units of their
    own, and the path taken from it matched them one by one for good (wgan_gp's generator: a
    dozen layer calls a step through Keras' Python, where one unit was skipped)."""
    if it.switch(d, tried={id(it.path)}, accepts=accepts):
        return True
    if loose is not None and it.switch(d, tried={id(it.path)}, accepts=loose):
        return True
    it.fallback(d)
    return False


def _takes_data(new_feed):
    """Whether a path was traced with a feed of `new_feed`'s (slot, dtype, shape), or runs a
    shape group's graph that takes it (`_group_takes`)."""
    slot, dtype, shape = new_feed

    def accepts(q):
        specs = q.view.feed_specs
        return slot < len(specs) and specs[slot].dtype == dtype and \
            specs[slot].shape is not None and tuple(specs[slot].shape) == tuple(shape) or \
            _group_takes(q, new_feed)
    return accepts


def _group_takes(q, new_feed) -> bool:
    """Whether path `q`'s shape group relaxed feed `slot` to take `shape` (its ops, matched one
    by one, may then go on on the group's graph with shapes no member was traced with)."""
    g = q.group
    if g is None:
        return False
    slot, dtype, shape = new_feed
    feeds = g.relaxed.trace.feeds
    if slot >= len(feeds):
        return False
    spec = feeds[slot].spec
    return spec.dtype == dtype and spec.shape is not None and len(spec.shape) == len(shape) \
        and all(a is None or a == b for a, b in zip(spec.shape, shape))


# attributes Keras' Python sets on a layer's output tensor and later code reads: skipped whole,
# the call would return placeholders without them. A softmax's `_keras_logits` makes Keras'
# cross-entropies take the logits (a from-logits kernel); without it they clip and take the log
# of the probabilities, another op sequence whose gradients round differently from eager's. A
# tag whose value the trace made is carried (`GradUnit.tags`: skip mode sets it on the result's
# placeholder); any other keeps the call from being a unit.
_KERAS_TAGS = ("_keras_mask", "_keras_logits")
_CARRIED_TAGS = ("_keras_logits",)


def _result_tags(rec, outs):
    """`GradUnit.tags` of a call's flat results, or None where one holds a tag not carried."""
    tags = []
    for i, t in enumerate(outs):
        for name in _KERAS_TAGS:
            if not hasattr(t, name):
                continue
            v = getattr(t, name)
            ref = rec.ref_of(v) if name in _CARRIED_TAGS and \
                isinstance(v, tfp.EagerTensorBase) else None
            if not isinstance(ref, OutputRef):
                return None
            tags.append((i, name, ref))
    return tuple(tags)


def layer_call(session, layer, original, args, kwargs, loss=None, state=(), entered=False):
    """A built-in Keras layer call, a call of a plain Sequential or functional model made of
    built-in layers, or (`loss`) of a built-in Keras loss object, as one coarse unit (guarded on
    the object, its plain Python settings and, for a model, each of its layers and theirs,
    whether a tape records, the inputs' producers and plain arguments; data handed straight to
    it, an array or a tensor no recorded op made (the ids a functional model converted for its
    Embedding), is fed when the unit is skipped). A user-defined layer or model is a unit where
    its Python only computed while traced (user_units.py); its layers are units of their own
    too, for the iterations where its guard fails. `loss` (a built-in loss's call or a built-in
    metric's `update_state`) is the function that gives the object's settings; `state`, the
    variables the call reads and writes, which then stand for the object in the guard (a path
    renamed onto variables made anew, `sites.renamed_path`, names the new ones: a call of the
    new object passes it, one of the old object fails it)."""
    it = session.iteration
    if it is None or it.mode not in ON_PATH or session.layer_depth or \
            not (loss or getattr(layer, "built", False)):
        return original(layer, *args, **kwargs)
    model = not loss and not type(layer).__module__.startswith(tfp.KERAS_BUILTIN_LAYER_MODULES)
    user = False
    if loss:
        settings = loss(layer)
        if settings is None:
            return original(layer, *args, **kwargs)
    else:
        settings = layer_guards.builtin_settings(layer, model)
        if settings is None:  # a user-defined layer or model
            if not CONFIG.user_layer_units:
                return original(layer, *args, **kwargs)
            user, read = True, None
            if it.mode == Mode.SKIP:  # no unit of this layer here: no guard to compute
                unit = it.runner.view.units.get(it.runner.pos)
                if unit is None or unit.guard[0] != id(layer):
                    return original(layer, *args, **kwargs)
                read = unit.guard[1][1][1]  # the containers its traced Python read
            settings = layer_guards.user_settings(layer, read)
    # a call inside `stop_recording()` records no op: another unit than the recorded call
    settings = (tfp.tapes_recording(), settings)
    flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True) + list(state)
    # a call guarded on its variables is guarded on its class, not on the object: a metric
    # made anew every epoch matches the unit of the path renamed onto its variables
    owner = id(type(layer)) if state else id(layer)
    data = True  # may be handed data straight (external tensors and arrays, fed when skipped)
    if data and not all(isinstance(x, (tfp.Tensor, tfp.BaseResourceVariable, np.ndarray, bool,
                                       int, float, str, type(None))) for x in flat):
        return original(layer, *args, **kwargs)

    def guard_of(x):
        if isinstance(x, (bool, int, float, str, type(None))):
            return ("value", x)
        return guard_ref(session, it, x)

    if model and not entered and it.mode == Mode.SKIP and \
            it.runner.view.units.get(it.runner.pos) is None and \
            it.runner.pos >= it.runner.view.n and it.extended_elsewhere():
        pos = it.runner.pos
        d = Divergence(user_line(), "the end of the path", f"a call of {type(layer).__name__}",
                       pos, PAST_END, DivergenceKind.PAST_END)
        # (a path going on through the call's ops one by one, as its first op would take: a
        # model that is no unit, its output masked)
        if _enter_traced(it, d, lambda q: (u := q.view.units.get(pos)) is not None and
                         u.guard[:2] == (owner, settings), loose=lambda q: True):
            return layer_call(session, layer, original, args, kwargs, loss, state, True)
        args, kwargs = real_values(args), real_values(kwargs)  # (traced from here: its values)
    if it.mode == Mode.SKIP:
        unit = it.runner.view.units.get(it.runner.pos)
        guard = (owner, settings) + tuple(guard_of(x) for x in flat)
        if data and unit is not None and len(unit.guard) == len(guard) and \
                unit.guard[:2] == guard[:2]:
            runner = it.runner
            with session.internal():
                fed = _feed_data_inputs(runner, unit.guard, guard, flat)
                d, new_feed = runner.data_divergence, runner.new_feed
                if fed is None and _switch_for_data(runner, unit):
                    unit = runner.view.units.get(runner.pos)  # the same call's unit
                    guard = (owner, settings) + tuple(guard_of(x) for x in flat)
                    fed = _feed_data_inputs(runner, unit.guard, guard, flat)
                    d, new_feed = runner.data_divergence or d, runner.new_feed or new_feed
                runner.data_divergence = None
            if fed is None and (d is None or new_feed is None or entered or
                                _group_takes(it.path, new_feed)):
                return original(layer, *args, **kwargs)
            if fed is None:
                if _enter_traced(it, d, _takes_data(new_feed)):
                    return layer_call(session, layer, original, args, kwargs, loss, state, True)
                args, kwargs = real_values(args), real_values(kwargs)
            else:
                guard = fed
    if it.mode == Mode.SKIP:  # (not after a fallback above: then the call is traced)
        diverged = None
        if unit is not None and unit.guard == guard:
            try:
                with session.internal():
                    out = it.runner.gradient_unit(guard)
                return _pack_results(unit.structure, out)
            except Diverged as d:  # a value the layer's Python read differs: its ops decide
                diverged = d.divergence  # (not the exception: its traceback holds the frames)
        if diverged is not None and it.exe.gated(unit.start):
            # unless the graph's ops of the unit wait for its check: matched one by one, they
            # would never run (and a read of one of them would wait forever)
            it.fallback(diverged)
        else:
            if model:  # its layers may be units of their own
                return original(layer, *args, **kwargs)
            session.layer_depth += 1  # no unit here: match the layer's ops one by one
            try:
                return original(layer, *args, **kwargs)
            finally:
                session.layer_depth -= 1
    rec = it.recorder
    flat = [x._terra_materialize() if isinstance(x, Placeholder) else x for x in flat]
    guard = (owner, settings) + tuple(guard_of(x) for x in flat)
    start = len(rec.trace.records)
    depth = 0 if user else 1  # a user layer's layers are units of their own as well
    session.layer_depth += depth
    known = None
    if user and not purity.watching():  # a nested call's verdict joins its outer watch's
        known = layer_guards.known_verdict(layer, settings, flat)
    try:
        watch = contextlib.nullcontext(known) if known is not None or not user else \
            purity.watch(layer_guards.forced_codes(layer), layer_guards.denied_codes())
        with _unit_python(rec, library=not user) as reads, watch as watched:
            result = original(layer, *args, **kwargs)
    finally:
        session.layer_depth -= depth
    if user and known is None and not reads and watched.complete:
        layer_guards.remember_verdict(layer, settings, flat, watched)
    if known is not None:
        session.counters.verdicts_kept += 1
    if user:  # the containers its Python may have read: compared afresh every time
        settings = (settings[0], layer_guards.user_settings(
            layer, layer_guards.read_containers(layer, watched.attributes)))
    if data:  # after the call: data passed straight to it is a feed now
        guard = (owner, settings) + tuple(_data_feed(rec, x) or guard_of(x) for x in flat)
    with _terra_reads(it):  # (a metric's `update_state` returns None: no results)
        outs = [] if result is None else tf.nest.flatten(result, expand_composites=True)
        structure = _shape_of(result)
    refs = [rec.ref_of(t) if isinstance(t, tfp.EagerTensorBase) else None for t in outs]
    tags = _result_tags(rec, outs)
    usable = (not any(isinstance(g, tuple) and g[0] == "external" for g in guard[2:])
              and all(r is not None for r in refs) and tags is not None
              and not rec.too_long and len(rec.trace.records) > start)
    if usable and user:
        usable = layer_guards.impurity(watched, layer) is None
    if usable:
        rec.units[start] = GradUnit(start, len(rec.trace.records), guard, tuple(refs),
                                    structure=structure, reads=tuple(reads), tags=tags)
    return result

def function_call(session, fn, original, args, kwargs):
    """A `tf.function` call as one coarse unit, guarded on the function object, its plain
    Python arguments by value, its tensor arguments by producer (or feed slot), and whether a
    tape may record. Skip mode returns placeholders for the recorded outputs without calling
    TF (which would materialize placeholder arguments, and under a tape call `__forward_f`
    where the path may say otherwise); another guard diverges cleanly before the call."""
    it = session.iteration
    if it is None or session.internal_depth or hook.active() is None or not tf.executing_eagerly() \
            or tfp.function_runs_eagerly(fn):  # Terra's own calls, graphs, eager debugging
        return original(fn, *args, **kwargs)
    flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True)
    if it.mode == Mode.SKIP and it.runner.skipping:
        runner = it.runner
        mark = len(runner.fed_order)
        try:
            with session.internal():
                guard = _function_guard(session, it, fn, flat)
                name = getattr(fn, "__name__", "?")
                out = runner.gradient_unit(guard, f"call of tf.function {name}")
                unit = runner.last_unit
            return _pack_results(unit.structure, out)
        except Diverged as d:
            runner.rollback(mark)
            if runner.pos >= runner.view.n and not it.extended_elsewhere() and \
                    not it.tape_open():  # the loop is over
                with session.internal():
                    it.finish_past_end(_past_end(d.divergence))
                return original(fn, *real_values(args), **real_values(kwargs))
            it.fallback(d.divergence)
    if it.mode != Mode.TRACING or it.recorder is None or not it.recorder.recording or \
            it.recorder.in_unit:
        return original(fn, *args, **kwargs)
    rec = it.recorder
    if any(isinstance(x, Placeholder) for x in flat):  # bound after a fallback: tapes
        args, kwargs = real_values(args), real_values(kwargs)      # watch their values, not them
        flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True)
    start = len(rec.trace.records)
    result = original(fn, *args, **kwargs)
    end = len(rec.trace.records)
    guard = _function_guard(session, it, fn, flat)  # after the call: data arguments are feeds now
    with _terra_reads(it):
        outs = tf.nest.flatten(result, expand_composites=True)
        structure = _shape_of(result)
    refs = [rec.ref_of(t) if isinstance(t, tfp.EagerTensorBase) else None for t in outs]
    usable = (end > start and not rec.too_long
              and not any(isinstance(g, tuple) and g[0] == "external" for g in guard[2:])
              and all(r is not None or t is None for r, t in zip(refs, outs)))
    for r in rec.trace.records[start:end]:
        if r.route == "function":
            _check_function_body(session, rec.trace, r)
        if r.route == "function" and r.function.startswith("__forward_"):
            wrapped = session.tape_functions.get(r.function)
            if wrapped is None:
                functions = tfp.tape_functions_of(fn, r.function)
                if functions is None:
                    usable = False  # a fallback's replay could not record its gradient
                    continue
                wrapped = session.tape_functions[r.function] = tfp.TapeRecordedFunction(
                    rec.trace.functions[r.function], functions)
            for ref in r.inputs:
                var = rec.trace.variables.get(ref.key) if isinstance(ref, VariableRef) \
                    else None
                if isinstance(var, tfp.BaseResourceVariable):
                    wrapped.add_variable(var)
            rec.trace.functions[r.function] = wrapped
    if usable:
        rec.units[start] = GradUnit(start, end, guard, tuple(refs), structure=structure)
    return result

def api_call(session, fn, original, args, kwargs):
    """A program's call of a composite TF API function (`tfp.API_UNIT_FUNCTIONS`: a
    cross-entropy, ten ops of TF Python around its kernel; `API_UNIT_METHODS`: indexing a
    tensor, the tensor its first argument) as one coarse unit, guarded as a tf.function call is
    (`_function_guard`: the function, its plain arguments and index by value, its tensors by
    producer or feed, whether a tape may record) and on the tensor values its Python read.
    Inside a built-in layer, a loss object, a gradient or an optimizer's update it is theirs (no
    unit of its own). In skip mode a call whose guard fails runs its ops one by one, as a
    layer's does."""
    it = session.iteration
    if it is None or session.internal_depth or session.layer_depth or not CONFIG.api_units \
            or hook.active() is None or not tf.executing_eagerly():
        return original(fn, *args, **kwargs)
    flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True)
    if it.mode == Mode.SKIP and it.runner.skipping:
        runner = it.runner
        unit = runner.view.units.get(runner.pos)
        twin = unit is None and runner.view.twin_units.get(runner.pos)
        if twin:
            unit = twin
        if unit is None or unit.guard[0] is not fn:
            return original(fn, *args, **kwargs)
        mark = len(runner.fed_order)
        try:
            with session.internal():
                guard = _function_guard(session, it, fn, flat, unit)
                out = runner.twin_unit(unit, guard) if twin else \
                    runner.gradient_unit(guard, f"call of {fn.__name__}")
            return _pack_results(unit.structure, out)
        except Diverged as d:
            runner.rollback(mark)
            if not it.exe.gated(unit.start):
                return original(fn, *args, **kwargs)
            it.fallback(d.divergence)  # its ops wait for the unit's check: they never run
    if it.mode != Mode.TRACING or it.recorder is None or not it.recorder.recording or \
            it.recorder.in_unit:
        return original(fn, *args, **kwargs)
    rec = it.recorder
    if any(isinstance(x, Placeholder) for x in flat):  # bound after a fallback
        args, kwargs = real_values(args), real_values(kwargs)
        flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True)
    start = len(rec.trace.records)
    with _unit_python(rec) as reads:
        result = original(fn, *args, **kwargs)
    guard = _function_guard(session, it, fn, flat)  # after the call: data arguments are feeds now
    with _terra_reads(it):
        outs = tf.nest.flatten(result, expand_composites=True)
        structure = _shape_of(result)
    refs = [rec.ref_of(t) if isinstance(t, tfp.EagerTensorBase) else None for t in outs]
    if len(rec.trace.records) > start and not rec.too_long and \
            not any(isinstance(g, tuple) and g[0] == "external" for g in guard[2:]) and \
            all(r is not None for r in refs):
        rec.units[start] = GradUnit(start, len(rec.trace.records), guard, tuple(refs),
                                    structure=structure, reads=tuple(reads), api=True)
    return result


def _check_function_body(session, trace, r) -> None:
    """What the function record `r` hides: a stateful random op (a replayed graph instantiates
    its kernels anew and draws another sequence than eager). An output whose shape depends on
    data is fine: its placeholder has the shape the graph infers (unknown dimensions)."""
    atomic = trace.functions.get(r.function)
    atomic = getattr(atomic, "atomic", atomic)
    if atomic is None:
        return
    types = session.function_ops.get(r.function)
    if types is None:
        types = session.function_ops[r.function] = tfp.function_op_types(atomic)
    if types & UNSEEDED_RANDOM_OPS:
        trace.unseeded_random.append(r.index)

def _function_guard(session, it, fn, flat, unit=None) -> tuple:
    """(fn, tape may record, one entry per flat argument). In skip mode a tensor argument
    that the unit at the runner's position (or `unit`) first feeds is fed here (data passed
    straight to the function)."""
    if unit is None:
        unit = it.runner.view.units.get(it.runner.pos) if it.mode == Mode.SKIP else None
    want = unit.guard if unit is not None and len(unit.guard) == len(flat) + 2 and \
        unit.guard[0] is fn else None
    out = [fn, tfp.could_possibly_record()]
    for i, x in enumerate(flat):
        if want is not None and isinstance(x, Placeholder) and \
                placeholder_ref(x, it.runner) is None:
            x = x._terra_materialize()  # an earlier iteration's value: external data now
        if isinstance(x, (bool, int, float, str, bytes, type(None))):
            out.append(("value", type(x).__name__, x))
            continue
        if x is Ellipsis or isinstance(x, slice) and all(
                isinstance(v, (int, type(None))) for v in (x.start, x.stop, x.step)):
            out.append(("value", type(x).__name__, x))  # an index (a slice of tensors is not)
            continue
        if not isinstance(x, (tfp.Tensor, tfp.BaseResourceVariable)) and \
                _var_ref(x) is None:
            out.append(("external", type(x).__name__))
            continue
        g = guard_ref(session, it, x)
        if isinstance(g, tuple) and want is not None and isinstance(want[i + 2], FeedRef) \
                and isinstance(x, tfp.EagerTensorBase) and want[i + 2].slot not in \
                it.runner.fed:
            it.runner.feed(want[i + 2].slot, x, x)
            g = want[i + 2]
        out.append(g)
    return tuple(out)

def force_eager(session, what: str) -> None:
    """Something Terra does not compile (e.g. tape.jacobian): run it eagerly, untraced."""
    it = session.iteration
    if it is None or session.foreign():
        return
    if it.mode == Mode.SKIP:
        it.fallback(Divergence(user_line(), "a compiled op", what, it.runner.pos,
                               f"{what} runs eagerly"))
    if it.mode == Mode.TRACING:
        it.recorder.trace.unsupported.append(f"{what} is not compiled")
        it.recorder.trace.first_unsupported = 0


def router(session):
    """The hook's unit router for `session` (terra/tracing/hook.py, `route_units`): a coarse
    unit's call goes to its rule while an iteration runs on the session's thread; otherwise it
    runs unchanged."""
    def route(kind, original, obj, args, kwargs):
        if session.foreign() or session.iteration is None or not CONFIG.enabled:
            return original(obj, *args, **kwargs)
        return UNIT_RULES[kind](session, obj, original, args, kwargs)
    return route


def _apply_gradients_rule(session, opt, original, args, kwargs):
    return apply_gradients(session, opt, original, *args, **kwargs)


def _layer_rule(session, layer, original, args, kwargs):
    if not CONFIG.layer_units:
        return original(layer, *args, **kwargs)
    return layer_call(session, layer, original, args, kwargs)


def _loss_rule(session, loss, original, args, kwargs):
    if not CONFIG.layer_units:
        return original(loss, *args, **kwargs)
    return layer_call(session, loss, original, args, kwargs, loss=tfp.keras_loss_settings)


def _metric_rule(session, metric, original, args, kwargs):
    if not CONFIG.layer_units or any(getattr(x, "_keras_mask", None) is not None
                                     for x in (*args, *kwargs.values())):
        return original(metric, *args, **kwargs)  # (a mask changes its ops, unguarded)
    return layer_call(session, metric, original, args, kwargs, loss=tfp.keras_metric_settings,
                      state=[v.value for v in metric.variables])


def _function_rule(session, fn, original, args, kwargs):
    return function_call(session, fn, original, args, kwargs)


def _api_rule(session, fn, original, args, kwargs):
    return api_call(session, fn, original, args, kwargs)


# kind (terra/tracing/hook.py's unit patches) -> the rule that guards, records or skips the
# call as one unit (`tape.gradient` comes from the Terra tape itself: `gradient` above)
UNIT_RULES = {"apply_gradients": _apply_gradients_rule, "layer": _layer_rule,
              "loss": _loss_rule, "metric": _metric_rule, "function": _function_rule,
              "api": _api_rule}


def _past_end(d: Divergence) -> Divergence:
    return Divergence(d.location, d.expected, d.observed, d.position, PAST_END,
                      DivergenceKind.PAST_END)


@contextlib.contextmanager
def _unit_python(rec, tf_constants=False, library=True):
    """While the Python of a coarse unit runs under `rec` (tracing): its reads are marked
    `Fetch.in_unit`; with `tf_constants` (tape.gradient, apply_gradients), NumPy values it
    makes are TF's own constants (`ContinuingRecorder._ref`); a `library` unit (not a
    user-defined layer) runs with loop tracking paused (`locations.pause_tracking`). Yields the
    list of (ref, value) the unit's Python reads (`GradUnit.reads`)."""
    paused = pause_tracking() if library else False
    rec.unit_depth += 1
    if tf_constants:
        rec.in_unit = True
    outer, reads = rec.unit_reads, []
    rec.unit_reads = reads
    try:
        yield reads
    finally:
        resume_tracking(paused)
        rec.unit_depth -= 1
        rec.unit_reads = outer
        if outer is not None:
            outer.extend(reads)  # an enclosing unit depends on them too
        if tf_constants:
            rec.in_unit = False


@contextlib.contextmanager
def _terra_reads(it):
    """Values Terra reads while tracing are not the program's fetches (a composite's type spec,
    for one, reads its dense shape)."""
    rec = it.recorder if it.mode == Mode.TRACING else None
    if rec is None:
        yield
        return
    rec.muted += 1
    try:
        yield
    finally:
        rec.muted -= 1


def _shape_of(result):
    """`result` with every tensor (composites too) replaced by its TypeSpec: what a unit needs
    to pack placeholders back into the result's structure (`tf.nest.pack_sequence_as(...,
    expand_composites=True)`) without holding the traced tensors, which would pass for values
    the program keeps (`held_refs`) and be fetched, unread, every iteration."""
    return tf.nest.map_structure(
        lambda x: tf.type_spec_from_value(x)
        if isinstance(x, (tf.Tensor, tf.__internal__.CompositeTensor)) else x, result)


def real_values(structure):
    """`structure` with placeholders replaced by their values (the tape knows only those)."""
    if structure is None:
        return None
    return tf.nest.map_structure(
        lambda x: x._terra_materialize() if isinstance(x, Placeholder) else x, structure,
        expand_composites=True)


def _var_ref(x):
    if isinstance(x, tfp.EagerTensorBase) or x is None:
        return None
    h = getattr(x, "handle", None)
    if isinstance(h, tfp.EagerTensorBase):
        return VariableRef(id(h))
    return None
