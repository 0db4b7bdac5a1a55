"""Variables by role: which variable a path's variable stands for once the program has made it anew.

A program that makes a `keras.metrics.Mean()` every epoch, or a model per task, runs the same ops
on new variable objects. A path names variables by identity, so its graph would not serve the new
ones; `sites.variable_renaming` lets a traced iteration run the old graph over them, but only
after a fallback found them. Here each eager variable gets a *role* when it is made: the call
stack that made it (code object and bytecode offset of every frame) and a sequence number. A
compiled path's variable is *superseded* when variables of its role were made after it; the
iteration is then predicted on the path renamed onto the newest of them (`superseding`), whose
graph is the old one with the new handles captured. The prediction is checked as any other: an
op on the old variable diverges and switches back.
"""
from __future__ import annotations

import sys
import weakref

__all__ = ["VariableRoles"]

_MAX_DEPTH = 64  # frames of a role's call stack (deeper ones are left out)


class VariableRoles:
    def __init__(self):
        self.seq = 0          # variables filed so far: a path is checked again only when it grew
        self._made: dict = {}  # role -> weak references to its variables, oldest first

    def created(self, variable) -> None:
        """File `variable` (just made) under the call stack that made it."""
        f = sys._getframe(2)  # the caller of the hook's wrapper of TF's initializer
        stack = []
        while f is not None and len(stack) < _MAX_DEPTH:
            stack.append((f.f_code, f.f_lasti))
            f = f.f_back
        self.created_at(variable, tuple(stack))

    def created_at(self, variable, role) -> None:
        """File `variable` under `role`, as made now."""
        self.seq += 1
        variable._terra_role = (role, self.seq)
        refs = self._made.setdefault(role, [])
        refs[:] = [r for r in refs if r() is not None]
        refs.append(weakref.ref(variable))

    def superseding(self, variables: dict) -> dict:
        """`{key: new variable}` for the variables of `variables` (key -> variable, as in
        `Trace.variables`) whose role has newer variables of the same dtype and shape: of a
        role with n variables in `variables`, the n newest variables made after all of them,
        matched in the order they were made. A role with fewer new variables than old ones, or
        another dtype or shape among them, is left as it is."""
        by_role: dict = {}
        for key, v in variables.items():
            tag = v.__dict__.get("_terra_role") if hasattr(v, "__dict__") else None
            if tag is not None:
                by_role.setdefault(tag[0], []).append((tag[1], key, v))
        out = {}
        for role, olds in by_role.items():
            olds.sort(key=lambda t: t[0])
            last = olds[-1][0]
            news = [v for r in self._made.get(role, ()) if (v := r()) is not None and
                    v.__dict__["_terra_role"][1] > last]
            if len(news) < len(olds):
                continue
            news = news[len(news) - len(olds):]
            if all(n.dtype == o.dtype and n.shape == o.shape for (_, _, o), n in zip(olds, news)):
                out.update((key, n) for (_, key, _), n in zip(olds, news))
        return out
