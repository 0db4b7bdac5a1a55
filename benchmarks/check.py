"""Wrong-result detection: a mode must reproduce eager's per-step losses and final variables from
identical initial states and data. A silent mismatch is a failure with a reason, like an exception.

Tolerances: the first step starts from bit-identical variables and data, so its loss must agree
tightly (rtol 1e-5): only the rounding of graph rewrites (oneDNN fusions, XLA) separates them.
Training then amplifies rounding (Adam turns noise-level gradients into full-size updates, GANs
are chaotic), so later steps and the final variables are held to ``drift_rtol`` (1e-3). The
errors this is meant to catch are far larger: a frozen ``keep_prob`` or random choice changes
the loss by percents at the first step where it matters."""
import numpy as np


def first_line(exc):
    """``Type: message`` in one line. tf.function errors open with "in user code:" and a traceback;
    their last line is the message that says what went wrong."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    msg = lines[-1] if lines and lines[0].startswith("in user code") else (lines[0] if lines else "")
    name = type(exc).__name__
    return (msg if msg.startswith(name + ":") else f"{name}: {msg}")[:300]


def compare_losses(ref, got, rtol, atol, drift_rtol=None):
    """``ref``/``got``: {step: loss}. The first common step is held to ``rtol``, later ones to
    ``drift_rtol`` (default ``rtol``). Returns a reason for the first differing step, or None."""
    steps = sorted(set(ref) & set(got))
    for i in steps:
        a, b = got[i], ref[i]
        tol = rtol if i == steps[0] or drift_rtol is None else drift_rtol
        if not np.isclose(a, b, rtol=tol, atol=atol, equal_nan=True):
            return f"loss differs at step {i}: {a:.8g} vs eager {b:.8g} (|diff| {abs(a - b):.3g})"
    return None


def variable_diff(ref, got):
    """Global relative L2 difference over all float variables, and the variable with the largest
    absolute difference. Global, because a parameter whose true gradient is zero (e.g. an attention
    key bias) gets Adam updates of full size driven by rounding noise alone: element-wise checks
    would call a correct graph wrong."""
    num = den = 0.0
    worst = ("", 0.0)
    for (name, b), (_, a) in zip(ref, got):
        if a.dtype.kind not in "fc":
            continue
        d = a.astype(np.float64) - b
        num += float(np.sum(d * d))
        den += float(np.sum(np.square(b.astype(np.float64))))
        m = float(np.max(np.abs(d))) if d.size else 0.0
        if not np.isnan(worst[1]) and not m <= worst[1]:  # a nan, once seen, stays the worst
            worst = (name, m)
    return (np.sqrt(num / den) if den > 0 else np.sqrt(num)), worst


def compare_variables(ref, got, rtol):
    """``ref``/``got``: lists of (name, ndarray) in the same order. Reason string or None."""
    if len(ref) != len(got):
        return f"{len(got)} variables vs {len(ref)} in eager"
    for (name, b), (_, a) in zip(ref, got):
        if a.shape != b.shape:
            return f"variable {name} has shape {a.shape} vs {b.shape} in eager"
        if a.dtype.kind not in "fc" and not np.array_equal(a, b):
            return f"variable {name} differs from eager"
    rel, (name, d) = variable_diff(ref, got)
    if not rel <= rtol:
        return f"final variables differ from eager: relative L2 {rel:.3g} (largest in {name}: {d:.3g})"
    return None


def max_rel_loss_diff(ref, got):
    common = sorted(set(ref) & set(got))
    if not common:
        return None
    return max(abs(got[i] - ref[i]) / max(abs(ref[i]), 1e-12) for i in common)
