"""The package's layering, checked on the source: data flows hook -> tracing -> compiler ->
runtime; `compiler/`, `ir/` and `tracing/` never import `runtime/` (or what sits on it); no
module imports another module's private name; private TF and Keras APIs are imported only by
`terra/_tf_private.py`."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "terra")


def _modules():
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                yield os.path.relpath(path, os.path.dirname(ROOT)), path


def _imports(path):
    """(module imported, names imported from it) for every import statement, nested ones too."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, tuple(a.name for a in node.names)


LOWER_LAYERS = ("terra/compiler/", "terra/ir/", "terra/tracing/")
UPPER = ("terra.runtime", "terra.pipeline", "terra.tape", "terra.launch")


@pytest.mark.parametrize("rel, path", [m for m in _modules() if m[0].startswith(LOWER_LAYERS)],
                         ids=lambda v: v if isinstance(v, str) and v.startswith("terra/") else "")
def test_lower_layers_never_import_the_runtime(rel, path):
    bad = [m for m, _ in _imports(path) if m.startswith(UPPER)]
    assert not bad, f"{rel} imports {bad}"


def test_no_module_imports_another_modules_private_name():
    bad = []
    for rel, path in _modules():
        for module, names in _imports(path):
            if not module.startswith("terra"):
                continue
            for n in names:
                if n.startswith("_") and n != "_tf_private" and not n.startswith("__"):
                    bad.append(f"{rel}: from {module} import {n}")
    assert not bad, "\n".join(bad)


def test_private_tf_and_keras_apis_only_in_tf_private():
    bad = []
    for rel, path in _modules():
        if rel == os.path.join("terra", "_tf_private.py"):
            continue
        for module, _ in _imports(path):
            if module.startswith(("tensorflow.python", "tensorflow._api", "keras.src")):
                bad.append(f"{rel}: {module}")
    assert not bad, "\n".join(bad)


def test_the_iteration_never_asks_which_graph_it_runs():
    """The iteration and the session talk to an Executable (terra/runtime/executable.py); no
    branch on whether it is a path's graph or the site's."""
    bad = []
    for name in ("iteration.py", "iteration_end.py", "session.py", "units.py"):
        with open(os.path.join(ROOT, "runtime", name), encoding="utf-8") as f:
            src = f.read()
        for needle in ("site_run", "isinstance(self.exe", "isinstance(it.exe",
                       "SiteRun)", "PathRun)"):
            if needle in src:
                bad.append(f"{name}: {needle}")
    assert not bad, bad
