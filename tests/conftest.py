"""Suite-wide set-up that must happen before TensorFlow initializes its devices."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# The pipeline tests place stages on logical CPUs; TF can split the CPU only before the first op
# runs, and any test module may run one at import time, so split it here, first.
_cpu = tf.config.list_physical_devices("CPU")[0]
try:
    tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
except RuntimeError:  # devices already initialized (e.g. a plugin imported TF and ran an op)
    pass


@pytest.fixture
def fresh_terra():
    """Terra reset before and after the test: no site, path, graph or unit patch is left from
    another test, and none of this test's is left for the next (`pytestmark =
    pytest.mark.usefixtures("fresh_terra")` in a module)."""
    import terra   # here, not at import: the pipeline tests never load the runtime
    terra.reset()
    yield
    terra.reset()


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for a test that sends a simulated Ctrl-C
    (`_thread.interrupt_main`), whatever this process inherited: a process started in the
    background by a non-interactive shell (`make test &`) begins with SIGINT ignored, Python then
    installs no handler of its own, and `interrupt_main` does nothing (the test would wait out
    its bound)."""
    import signal
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)



@pytest.fixture(autouse=True)
def _settings_put_back(request):
    """Fail a test that leaves a `terra.config` setting changed (and put it back): under
    `make test` tests run in two processes in an order that changes with the machine's speed,
    so a setting left behind changes whichever test comes next in that process."""
    import sys
    terra = sys.modules.get("terra")  # (the pipeline tests never load the runtime)
    before = terra.config() if hasattr(terra, "config") else None
    yield
    terra = sys.modules.get("terra")
    if not hasattr(terra, "config"):  # (not imported, or its import failed)
        return
    if before is None:
        from terra.config import Config
        import dataclasses
        before = dataclasses.asdict(Config())
    after = terra.config()
    if after != before:
        changed = {k: (before[k], after[k]) for k in before if after[k] != before[k]}
        terra.config(**before)
        pytest.fail(f"{request.node.nodeid} left terra settings changed "
                    f"(setting: (before, after)): {changed}", pytrace=False)
