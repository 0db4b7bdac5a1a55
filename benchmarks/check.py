"""Wrong-result detection: from an identical state (same variables, same data), a mode must give
eager's loss and eager's update. A silent mismatch is a failure with a reason, like an exception.

Why steps from identical states and not whole trajectories: training amplifies rounding. Graph
rewrites (oneDNN fusions, XLA) change the last bits of a loss (about 1e-6 relative), but they
change gradients far more where backpropagation cancels (through BatchNorm: after one ResNet-50
step, eager and tf.function variables differ by up to 6e-4), Adam turns noise-level gradients of
parameters whose true gradient is zero (attention key biases) into full-size updates, and GANs
are chaotic. Free-running eager and graph trajectories of correct programs therefore part after a
few steps (ResNet-50: 0.5% at step 1, 11% at step 2). So the harness loads eager's variables before
each checked step and compares (1) the loss, rtol 1e-5, and (2) the update, as the relative L2
difference of the whole update vector, below ``update_rtol`` (0.1): a skipped or mis-scaled update
is off by O(1). A frozen ``keep_prob`` or random choice changes the loss by percents."""
import re

import numpy as np


def first_line(exc):
    """``Type: message`` in one line. tf.function errors open with "in user code:" and a traceback;
    their last line is the message that says what went wrong."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    msg = lines[-1] if lines and lines[0].startswith("in user code") else (lines[0] if lines else "")
    msg = re.sub(r"\[[^\]]{40,}\]", "", msg)  # drop long attribute lists such as [_XlaMustCompile=...]
    name = type(exc).__name__
    return (msg if msg.startswith(name + ":") else f"{name}: {msg}")[:300]


def compare_losses(ref, got, rtol, atol):
    """``ref``/``got``: {step: loss}. Returns a reason for the first differing step, or None."""
    for i in sorted(set(ref) & set(got)):
        a, b = got[i], ref[i]
        if not np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
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


def compare_update(before, ref_after, got_after, rtol, step):
    """The update of one step from the same state ``before``: relative L2 distance between the
    mode's and eager's update vectors over all float variables. Reason string or None."""
    if [x.shape for _, x in got_after] != [x.shape for _, x in ref_after]:
        return f"step {step}: variables differ in number or shape from eager's after the step"
    num = den = 0.0
    for (name, b), (_, r), (_, g) in zip(before, ref_after, got_after):
        if b.dtype.kind not in "fc":
            if not np.array_equal(r, g):
                return f"step {step}: variable {name} updated differently from eager"
            continue
        du_ref, du_got = r.astype(np.float64) - b, g.astype(np.float64) - b
        num += float(np.sum(np.square(du_got - du_ref)))
        den += float(np.sum(np.square(du_ref)))
    rel = np.sqrt(num / den) if den > 0 else np.sqrt(num)
    if not rel <= rtol:
        return f"update of step {step} differs from eager's: relative L2 {rel:.3g}"
    return None


def max_rel_loss_diff(ref, got):
    common = sorted(set(ref) & set(got))
    if not common:
        return None
    return max(abs(got[i] - ref[i]) / max(abs(ref[i]), 1e-12) for i in common)
