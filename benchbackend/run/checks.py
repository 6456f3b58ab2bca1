"""Correctness checks: NaN/inf loss, chance-level accuracy, parity against the reference.

Pure functions of measured numbers; the runner applies them to a cell's rows and sets the
cell's status. NumPy only (SciPy is imported inside ``chance_pvalue``), so the worker can use
``finite`` and ``parity_errors`` from any backend's environment.

Over 400 lines: every check a cell's status is decided by, beside the one function that decides it
(``cell_status``), so that its order of precedence reads in one place.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import numpy as np


def finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def nan_loss(losses: Sequence[Optional[float]]) -> Optional[str]:
    """A message when any training loss is NaN or infinite, else None."""
    for i, loss in enumerate(losses, start=1):
        if loss is None:
            continue
        if not math.isfinite(loss):
            return f"training loss is {loss} at epoch {i}"
    return None


def chance_pvalue(accuracy: float, n: int, num_classes: int) -> float:
    """One-sided binomial test p-value of ``accuracy`` on ``n`` samples against 1/num_classes."""
    from scipy.stats import binomtest

    k = int(round(accuracy * n))
    return float(binomtest(k, n, 1.0 / num_classes, alternative="greater").pvalue)


def chance_accuracy(accuracy: Optional[float], n: int, num_classes: int, alpha: float,
                    margin: Optional[float] = None, what: str = "validation") -> Optional[str]:
    """A message when ``accuracy`` is not clearly above chance, else None.

    With ``margin`` set the rule is ``accuracy > 1/num_classes + margin``; otherwise a one-sided
    binomial test at level ``alpha``. ``what`` names the accuracy in the message.
    """
    chance = 1.0 / num_classes
    if accuracy is None or not math.isfinite(accuracy) or n <= 0:
        return f"no final {what} accuracy to check (chance is {chance:.3f})"
    if margin is not None:
        if accuracy <= chance + margin:
            return f"{what} accuracy {accuracy:.4f} is not above chance {chance:.3f} + margin {margin}"
        return None
    p = chance_pvalue(accuracy, n, num_classes)
    if p >= alpha:
        return (f"{what} accuracy {accuracy:.4f} on {n} samples is not significantly above chance "
                f"{chance:.3f} (binomial p={p:.3g} >= {alpha})")
    return None


#: Batchnorm's moving statistics that still hold more than this share of their initial values
#: (mean 0, variance 1) do not describe the trained network yet: inference mode is not trained.
UNTRAINED_MOVING = 0.1


def initial_share(workload: Any, steps: int) -> float:
    """The share of batchnorm's moving statistics still from their initial values after ``steps``
    training steps: ``momentum ** steps`` of the slowest batchnorm layer (0.0 without batchnorm)."""
    momenta = [layer.momentum for layer in workload.model if layer.type == "batchnorm"]
    return max(momenta) ** steps if momenta else 0.0


def _chance(epochs: Sequence[dict[str, Any]], workload: Any) -> Optional[tuple[str, str]]:
    """The chance check of a cell that trained, on the final validation accuracy: ``chance_accuracy``
    when it is at chance. While the batchnorm moving statistics still hold more than
    ``UNTRAINED_MOVING`` of their initial values (a run of a few steps: the inference mode that
    validation uses is untrained on every backend, the reference included), a validation accuracy
    at chance says nothing of the backend: the cell is then ``not_judged`` when its training
    accuracy (batch statistics) is above chance, and ``chance_accuracy`` when that is at chance too.
    Either way it is not correct, and no speed-up is claimed for it."""
    last, c = epochs[-1], workload.checks
    val = chance_accuracy(last.get("val_accuracy"), int(last.get("val_samples") or 0), workload.num_classes,
                          c.chance_alpha, c.chance_margin)
    steps = sum(int(r.get("steps") or 0) for r in epochs)
    share = initial_share(workload, steps)
    if not val or share <= UNTRAINED_MOVING:
        return ("chance_accuracy", val) if val else None
    train = chance_accuracy(last.get("accuracy"), int(last.get("samples") or 0), workload.num_classes,
                            c.chance_alpha, c.chance_margin, what="training")
    if train:
        return "chance_accuracy", f"{val}; {train}"
    need = math.ceil(math.log(UNTRAINED_MOVING) / math.log(max(share ** (1 / steps), 1e-12))) if steps else 0
    return "not_judged", (f"batchnorm's moving statistics have not settled at this size ({steps} steps: "
                          f"{share:.0%} of their initial values remain; {need} steps leave {UNTRAINED_MOVING:.0%}), "
                          f"so validation accuracy {float(last['val_accuracy']):.3f} is at chance; training "
                          f"accuracy {float(last['accuracy']):.3f} is not. Train longer (--limit, --epochs) to "
                          "judge it")


#: A language model's validation loss must sit this many nats below the unigram entropy (what a
#: model that ignores the context reaches at best) to count as learned (the chance check's token form).
TOKEN_CHANCE_MARGIN = 0.05
#: A validation loss below ``(1 - FUTURE_LEAK_MARGIN)`` times the data's entropy floor is
#: ``future_leak``: no causal model gets there (the floor is the Bayes-optimal predictor's expected
#: loss); a model that sees the next token does (a missing or shifted causal mask).
FUTURE_LEAK_MARGIN = 0.1


@functools.lru_cache(maxsize=8)
def _token_bounds(vocab: int, order: int, branching: int, seed: int, context: int) -> tuple[float, float]:
    from ..data.tokens import MarkovSource

    source = MarkovSource(vocab, order, branching, seed)
    pi = source.stationary()
    marginal = pi if order == 1 else pi.reshape(vocab, vocab).sum(axis=0)  # a context is earlier * vocab + latest
    marginal = marginal[marginal > 0]
    return source.floor(context), float(-(marginal * np.log(marginal)).sum())


_TEXT_UNIGRAM: dict[str, float] = {}  # by workload hash: a text is tokenized once per run for its checks


def _text_unigram(workload: Any) -> float:
    from ..data.language import text_sequences
    from ..data.tokens import unigram_entropy

    key = workload.hash()
    if key not in _TEXT_UNIGRAM:
        _TEXT_UNIGRAM[key] = unigram_entropy(text_sequences(workload).y_train, workload.num_classes)
    return _TEXT_UNIGRAM[key]


def token_bounds(workload: Any) -> Optional[tuple[Optional[float], float]]:
    """(floor, unigram entropy) in nats of a language model's data: the lowest expected next-token
    loss any causal model can reach (known for the synthetic ``tokens``; None for text), and the
    loss of the best context-free guess (the source's token frequencies; a text's training tokens'
    own). None for other data."""
    d = workload.data
    if d.dataset == "text":
        return None, _text_unigram(workload)
    if d.dataset != "tokens":
        return None
    return _token_bounds(d.vocab, d.order, d.branching, workload.seed, d.context)


def token_checks(epochs: Sequence[dict[str, Any]], workload: Any) -> Optional[tuple[str, str]]:
    """(status, message) when a language model's final validation loss is below its data's floor
    (``future_leak``) or not clearly below the unigram entropy (``chance_accuracy``, the token form
    of the chance check), else None."""
    bounds = token_bounds(workload)
    loss = epochs[-1].get("val_loss")
    if bounds is None:
        return None
    floor, unigram = bounds
    if not finite(loss):
        return "chance_accuracy", f"no final validation loss to check (the unigram entropy is {unigram:.3f} nats)"
    if floor is not None and loss < (1 - FUTURE_LEAK_MARGIN) * floor:
        return "future_leak", (f"validation loss {loss:.4f} is below the data's entropy floor {floor:.4f} nats, which "
                               "no causal model can reach: the model sees tokens it should predict (a missing or "
                               "shifted causal mask)")
    if loss > unigram - TOKEN_CHANCE_MARGIN:
        return "chance_accuracy", (f"validation loss {loss:.4f} is not below the unigram entropy {unigram:.4f} "
                                   f"- {TOKEN_CHANCE_MARGIN} nats (a model that ignores the context)")
    return None


def parity_errors(out: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max absolute error, max error relative to the reference's largest magnitude)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf"), float("inf")
    if not (np.all(np.isfinite(out)) and np.all(np.isfinite(ref))):
        return float("inf"), float("inf")
    abs_err = float(np.max(np.abs(out - ref))) if out.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return abs_err, abs_err / max(scale, 1e-30)


def parity_mismatch(max_abs: float, max_rel: float, rtol: float, atol: float) -> Optional[str]:
    """A message when the errors exceed the workload's tolerance (either bound passing is enough)."""
    if max_rel <= rtol or max_abs <= atol:
        return None
    return (f"forward output differs from the NumPy reference: max abs {max_abs:.3g}, max rel {max_rel:.3g} "
            f"> rtol {rtol:g}")


def trajectory(msg: dict[str, Any], workload: Any, precision: str = "fp32") -> dict[str, Any]:
    """The trajectory row (``--parity-steps``) decided from the worker's raw per-step losses.

    Adds ``parity_step`` (the first step whose loss differs from the reference's by more than its
    tolerance, relative, or is not finite), the largest errors, and ``notes`` that say what was
    found (the cell's ``run`` row repeats it as the reason when it fails). Step k's tolerance is
    ``checks.trajectory(precision, K)``: fp32's ``trajectory_rtol * trajectory_growth ** (k - 1)``
    (on a chaotic network correct float32 trajectories part from the float64 reference
    exponentially, step by step), and at bf16, fp16 or tf32 the larger of that and the precision's
    own measured bound (``checks.trajectory_tolerance``).
    """
    losses, ref = list(msg.get("losses") or []), list(msg.get("reference_losses") or [])
    tols = workload.checks.trajectory(precision, len(ref))
    errs = [abs(a - b) for a, b in zip(losses, ref)]
    rels = [e / max(abs(b), 1e-12) for e, b in zip(errs, ref)]
    first = next((i + 1 for i, (a, r, t) in enumerate(zip(losses, rels, tols)) if not math.isfinite(a) or r > t),
                 None)
    out = {k: v for k, v in msg.items() if k not in ("losses", "reference_losses")}
    out.update(parity_step=first, parity_max_abs=max(errs) if errs else None,
               parity_max_rel=max(rels) if rels else None, steps=len(losses))
    within = (f"{tols[0]:g}" if len(set(tols)) <= 1 else f"{tols[0]:.3g} (step 1) to {tols[-1]:.3g} "
              f"(step {len(tols)})") + f" ({precision})"
    if first is None and len(losses) != len(ref):  # a step skipped (a dropped last batch, say) is a mismatch
        first = min(len(losses), len(ref)) + 1
        out.update(parity_step=first, notes=f"training gave {len(losses)} step losses for the reference's "
                                            f"{len(ref)} steps")
        return out
    out["notes"] = (f"{len(losses)} steps agree within {within}" if first is None else
                    f"training loss diverges from the reference at step {first}: "
                    f"{losses[first - 1]:.6g} vs {ref[first - 1]:.6g} (rtol {tols[first - 1]:.3g}, {precision})")
    return out


def generation(ids: np.ndarray, ref: np.ndarray, gaps: np.ndarray, tie: float) -> dict[str, Any]:
    """Greedy parity of a generation: ``ids`` (B, K) a backend's first K tokens per prompt, ``ref``
    the float64 reference's, ``gaps`` the reference's top-two gap at each step relative to the top
    output, ``(p1 - p2) / p1``. Per prompt, the steps are compared in order until the first tie (a
    gap of at most ``tie``: two outputs the precision cannot order; the comparison stops there, since
    either token is right and every later step then depends on which was taken). A token that differs
    before its prompt's first tie is a mismatch (``generation_mismatch``).

    Returns the ``greedy`` row's columns: ``tokens_matched`` (over every prompt), ``tie_step`` (the
    earliest tie, 1-based, or None), ``mismatch_step`` (the first mismatch's step, or None), ``notes``.
    """
    ids, ref, gaps = np.asarray(ids), np.asarray(ref), np.asarray(gaps)
    matched, ties, mismatch = 0, [], None
    for b in range(len(ref)):
        for k in range(ref.shape[1]):
            if gaps[b, k] <= tie:
                ties.append(k + 1)
                break
            if ids[b, k] != ref[b, k]:
                if mismatch is None or k + 1 < mismatch[0]:
                    mismatch = (k + 1, b + 1, int(ids[b, k]), int(ref[b, k]), float(gaps[b, k]))
                break
            matched += 1
    total = ref.size
    tie_step = min(ties) if ties else None
    tied = f"; {len(ties)} of {len(ref)} prompt(s) reach a tie (first at step {tie_step})" if ties else ""
    if mismatch is not None:
        step, prompt, got, want, gap = mismatch
        notes = (f"greedy tokens differ from the reference at step {step} of prompt {prompt}: {got} vs {want} "
                 f"(the reference's top two {gap:.2g} apart, relative; ties are {tie:.2g} or closer)")
    else:
        notes = f"{matched} of {total} greedy tokens agree with the reference (tie below {tie:.2g}){tied}"
    return {"tokens_matched": matched, "tie_step": tie_step, "mismatch_step": None if mismatch is None else mismatch[0],
            "notes": notes}


def audit_indices(n: int, seed: int) -> np.ndarray:
    """The test samples whose timed outputs are audited: 1% of ``n``, at least 100 (all of a smaller
    set), chosen by the workload's seed, in order."""
    k = min(n, max(100, -(-n // 100)))
    return np.sort(np.random.default_rng([seed % 2**32, 13]).choice(n, size=k, replace=False))


def audit(timed: np.ndarray, untimed: np.ndarray, rtol: float, atol: float) -> Optional[tuple[int, str]]:
    """(the first audited sample's place, what differs) where a timed pass's outputs of the audited
    samples are not an untimed pass's of the same samples: a different top class, or outputs farther
    apart than the precision's forward tolerance (relative to the largest output, or absolute) allows.
    None when every sample agrees. Both passes ran on this backend, at this precision: only a pass
    that returns stale, cached or skipped outputs, or outputs of other samples, parts them."""
    return _first_apart(timed, untimed, rtol, atol, reference=False)


def reference_mismatch(out: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> Optional[tuple[int, str]]:
    """(the first sample's place, what differs) where ``out`` (a backend's outputs of the test split,
    from LoadGen's accuracy mode) is farther from the reference's ``ref`` than the precision's forward
    tolerance allows, by the forward parity check's rule (``parity_errors``, ``parity_mismatch``: max
    abs error, and relative to the reference's largest output); None when every sample is within it.
    A top class that differs within the tolerance (a near tie, at a lower precision) is no mismatch:
    ``top1_agreement`` counts those."""
    return _first_apart(out, ref, rtol, atol, reference=True)


def _first_apart(got: np.ndarray, want: np.ndarray, rtol: float, atol: float,
                 reference: bool) -> Optional[tuple[int, str]]:
    """(the first sample's place, what differs) where ``got`` is farther from ``want`` than the forward
    tolerance allows (``parity_mismatch``'s rule: max abs error, and relative to ``want``'s largest
    output); None when every sample agrees. ``reference``: ``want`` is the NumPy reference's outputs;
    else another pass of the same backend, whose top class must also be ``got``'s."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    whose, source = ("the reference's ", " from the NumPy reference's") if reference else ("", "")
    if got.shape != want.shape:
        return 0, f"outputs of shape {got.shape[1:]} for {whose}{want.shape[1:]}"
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-30)
    for i, (a, b) in enumerate(zip(got, want)):
        err = float(np.max(np.abs(a - b))) if a.size else 0.0
        if not np.isfinite(err) or parity_mismatch(err, err / scale, rtol, atol):
            return i, f"outputs differ{source} by {err:.3g} (max abs; {err / scale:.3g} relative)"
        if not reference:
            top_a, top_b = a.argmax(axis=-1), b.argmax(axis=-1)
            if np.any(top_a != top_b):
                return i, f"top class {int(np.ravel(top_a)[0])} vs {int(np.ravel(top_b)[0])}"
    return None


def top1_agreement(out: np.ndarray, ref: np.ndarray) -> float:
    """The share of samples whose top class in ``out`` is the reference's (``ref``)."""
    out, ref = np.asarray(out), np.asarray(ref)
    return float(np.mean(out.argmax(axis=-1) == ref.argmax(axis=-1))) if len(ref) else math.nan


def cache_mismatch(rows: Sequence[dict[str, Any]]) -> Optional[str]:
    """A message when a generation's key/value cache holds other bytes than the spec's cache
    dtype gives for the positions it holds (a bf16 cache where the spec says fp32, say)."""
    for r in rows:
        held, expected = r.get("cache_bytes"), r.get("cache_bytes_expected")
        if r.get("phase") == "prefill" and finite(held) and finite(expected) and held != expected:
            return (f"the key/value cache holds {held:,.0f} bytes; the spec's cache ({expected:,.0f} bytes for its "
                    f"positions) is {held / expected:.3g}x that")
    return None


def diverged(losses: Sequence[Optional[float]], num_classes: int, factor: float) -> Optional[str]:
    """A message when a finite training loss exploded: ``factor`` times ln(num_classes) or more.

    ln(classes) is the cross-entropy of a uniform guess, about what the shared initial weights
    give; the first epoch's mean is no yardstick, since a loss can explode within it (TensorFlow's
    mnist at learning rate 1e6: 1.3e20 in epoch 1, then 4.8e5)."""
    chance = math.log(num_classes)
    for i, loss in enumerate(losses, start=1):
        if loss is not None and math.isfinite(loss) and abs(loss) >= factor * chance:
            return (f"training loss exploded to {loss:.3g} at epoch {i} ({abs(loss) / chance:.2g}x the "
                    f"{chance:.3g} of a uniform guess)")
    return None


def time_to_accuracy(rows: Sequence[dict[str, Any]], target: float) -> float:
    """Training seconds (the sum of epoch times) at which the validation accuracy first reached
    ``target``; ``inf`` when it never did (DAWNBench's metric: speed that counts only when right)."""
    elapsed = 0.0
    for r in sorted((r for r in rows if r.get("phase") == "train_epoch"), key=lambda r: r.get("epoch") or 0):
        elapsed += float(r.get("seconds") or 0.0)
        acc = r.get("val_accuracy")
        if acc is not None and math.isfinite(acc) and acc >= target:
            return elapsed
    return math.inf


def epochs_to_target(rows: Sequence[dict[str, Any]], target: float) -> float:
    """The first epoch (1, 2, ...) whose validation accuracy reached ``target``; ``inf`` when none
    did (what MLPerf's convergence check counts, apart from how long an epoch took)."""
    for r in sorted((r for r in rows if r.get("phase") == "train_epoch"), key=lambda r: r.get("epoch") or 0):
        acc = r.get("val_accuracy")
        if acc is not None and math.isfinite(acc) and acc >= target:
            return float(r.get("epoch") or 0)
    return math.inf


def cell_status(rows: Sequence[dict[str, Any]], workload: Any, precision: str = "fp32") -> tuple[str, str]:
    """Final (status, message) of one cell from its worker rows (runner-level statuses aside).

    Order: ``nan_loss``, ``diverged``, ``parity_mismatch`` (forward at the precision's tolerance,
    then the trajectory), ``audit_failed`` (a timed epoch's step losses are not their recomputation,
    ``run/loss_audit.py``; a timed inference pass's outputs are not an untimed pass's),
    ``generation_mismatch`` (greedy tokens, then the cache's bytes), then for
    cells that trained ``chance_accuracy``, or for a language model ``future_leak`` and the token
    form of ``chance_accuracy`` (``token_checks``).
    """
    epochs = [r for r in rows if r.get("phase") == "train_epoch"]
    losses = [r.get("loss") for r in epochs]
    msg = nan_loss(losses)
    if msg:
        return "nan_loss", msg
    msg = diverged(losses, workload.num_classes, workload.checks.divergence_factor)
    if msg:
        return "diverged", msg
    tol = workload.checks.tolerance(precision)
    for r in rows:
        if r.get("phase") != "parity":
            continue
        if r.get("steps"):  # trajectory check: parity_step is the first diverging step, if any
            if finite(r.get("parity_step")):
                return "parity_mismatch", (r.get("notes") or
                                           f"training diverges from the reference at step {r['parity_step']}")
        elif r.get("parity_max_rel") is not None:
            msg = parity_mismatch(r["parity_max_abs"], r["parity_max_rel"], tol.rtol, tol.atol)
            if msg:
                return "parity_mismatch", f"{msg} ({precision})"
    for r in rows:
        if r.get("phase") == "train_epoch" and finite(r.get("audit_step")):  # loss_audit
            return "audit_failed", (r.get("notes") or
                                    f"training epoch {r.get('epoch')}, step {r['audit_step']}: reported loss differs")
    for r in rows:
        if r.get("phase") in ("inference", "scenario") and finite(r.get("audit_sample")):
            return "audit_failed", (r.get("notes") or
                                    f"timed pass {r.get('pass')} differs at test sample {r['audit_sample']}")
    for r in rows:
        if r.get("phase") == "greedy" and finite(r.get("mismatch_step")):
            return "generation_mismatch", r.get("notes") or f"greedy tokens differ at step {r['mismatch_step']}"
    msg = cache_mismatch(rows)
    if msg:
        return "generation_mismatch", msg
    if epochs and getattr(workload, "next_token", False):
        return token_checks(epochs, workload) or ("ok", "")
    if epochs:
        judged = _chance(epochs, workload)
        if judged:
            return judged
    return "ok", ""
