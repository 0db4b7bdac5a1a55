from terra.ir import ConstRef, Location, LoopIter, OpRecord, OutputRef, TensorSpec, VariableRef, replace


def _rec(index=0, loc=None, **kw):
    loc = loc or Location(("m.py:f@10",))
    base = dict(index=index, op_type="AddV2", attrs=(("T", "float32"),),
                inputs=(OutputRef(0), ConstRef(1.0, "float32")),
                outputs=(TensorSpec("float32", (2, 2)),), location=loc)
    base.update(kw)
    return OpRecord(**base)


def test_records_are_hashable_and_compare_by_value():
    assert _rec() == _rec()
    assert hash(_rec()) == hash(_rec())
    assert _rec().signature != _rec(attrs=(("T", "float64"),)).signature


def test_location_site_drops_iteration_numbers_only():
    a = Location(("m.py:f@10",), (LoopIter("m.py:f@4", 0),))
    b = Location(("m.py:f@10",), (LoopIter("m.py:f@4", 3),))
    assert a != b
    assert a.site == b.site
    assert a.site != Location(("m.py:f@12",), (LoopIter("m.py:f@4", 0),)).site


def test_repr_is_readable():
    r = _rec(index=3, inputs=(OutputRef(1, 2), VariableRef(7)))
    text = repr(r)
    assert text.startswith("%3 = AddV2(%1:2, $var7)")
    assert "float32[2x2]" in text
    assert repr(replace(r, outputs=(TensorSpec("int32", (None,)),))).count("int32[?]") == 1


def test_input_refs_flattens_list_inputs_in_order():
    r = _rec(op_type="AddN", inputs=((OutputRef(0), OutputRef(1)),))
    assert r.input_refs() == (OutputRef(0), OutputRef(1))
    assert _rec().input_refs() == (OutputRef(0), ConstRef(1.0, "float32"))
    mixed = _rec(op_type="ConcatV2", inputs=((OutputRef(0), OutputRef(2)), ConstRef(0, "int32")))
    assert mixed.input_refs() == (OutputRef(0), OutputRef(2), ConstRef(0, "int32"))
