"""The runtime package exports the primitives the assembled runtime builds on."""
import terra.runtime as rt


def test_public_names_resolve():
    for name in rt.__all__:
        assert getattr(rt, name) is not None, name
    assert issubclass(rt.TerraTimeoutError, TimeoutError)
