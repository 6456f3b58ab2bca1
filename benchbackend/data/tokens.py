"""Token data for decoder language models: a seeded Markov source whose loss floor is known exactly,
and the user's own UTF-8 text, tokenized by byte or by a byte-level BPE, cut into windows.

Conventions (every function below follows them):

- **Next-token prediction.** A model reads ``x[:, :L]`` and predicts ``y = x[:, 1:L + 1]``: at
  position t it has seen tokens 0..t and predicts token t + 1. Losses are in nats, per position.
- **Markov source.** ``MarkovSource(vocab, order, branching, seed)``: each context (the last token
  for order 1; the last two for order 2) has ``branching`` distinct successor tokens with
  probabilities drawn from a Dirichlet(1.0). A context is one integer: the token itself for order 1,
  ``earlier * vocab + latest`` for order 2. Its entropy rate is exact (a sum over the stationary
  distribution, not an estimate), and so is ``floor(L)``, the expected loss of the Bayes-optimal
  causal predictor: no causal model can go below it, and a validation loss that does has seen the
  future (``future_leak``).
- **Streams.** ``sample(n, length, stream)`` is a pure function of (seed, stream, sequence index,
  position): sequence i never depends on how many sequences are drawn, nor token t on the length
  (a smaller request is a prefix of a larger one, in both axes), like ``synthetic.py``'s images.
- **Text.** ``read_text`` reads one file or a folder (rules in its docstring); ``byte_tokens`` gives
  UTF-8 bytes (vocab 256); ``bpe_tokens`` trains a byte-level BPE (``tokenizers``) on the text and
  encodes it. ``split_by_position`` cuts a stream into train, validation, test in that order (no
  token in two splits), and ``windows`` cuts each into non-overlapping windows with targets
  shifted by one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import numpy as np

from .synthetic import seed_key

#: Sequences drawn per random stream: sequence i of ``sample`` comes from block i // _BLOCK.
_BLOCK = 1024
_TAG_STRUCTURE, _TAG_SAMPLE = 11, 12
#: Power iteration (``MarkovSource.stationary``): stop when the L1 change of the distribution and
#: the error it implies (change * r / (1 - r), r the ratio of the last two changes) are below _TOL.
#: The first _PLAIN steps apply the transitions P, fast for the well-mixing chains of a real vocab
#: (vocab 512, order 2: about 75 steps); then (I + P) / 2, the lazy chain, which has the same
#: stationary distribution and no eigenvalue near -1, so a nearly periodic chain (a small vocab with
#: a self-loop of probability 0.002 closing a cycle) converges too. ValueError after
#: _MAX_WORK / (contexts * branching) steps (at least _MIN_ITER, at most _MAX_ITER): the chain is
#: irreducible and aperiodic by construction, so only one that mixes pathologically slowly (some
#: probabilities near 0 or 1 on a small vocab) reaches that cap.
_TOL, _PLAIN, _MIN_ITER, _MAX_ITER, _MAX_WORK = 1e-13, 256, 2_000, 200_000, 2e9


def _distinct(rng: np.random.Generator, n: int, k: int, high: int) -> np.ndarray:
    """(n, k) int64: in each row, k distinct values of 0..high-1, the set uniform (Floyd's algorithm,
    vectorised over rows; the order within a row is not uniform, which nothing here relies on)."""
    out = np.empty((n, k), np.int64)
    for col, j in enumerate(range(high - k, high)):
        t = rng.integers(0, j + 1, n)
        seen = (out[:, :col] == t[:, None]).any(axis=1)
        out[:, col] = np.where(seen, j, t)
    return out


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """-sum p log p along ``axis``, with 0 log 0 = 0 (nats)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0.0).sum(axis=axis)


class MarkovSource:
    """A seeded Markov source of tokens of order 1 or 2 with an exactly known entropy rate.

    ``vocab`` tokens 0..vocab-1 (at least 2); ``order`` 1 or 2; ``branching`` successors per context
    (2..vocab); ``seed`` any int. Stored sparse: ``successors`` (n_contexts, branching) int64, the
    distinct tokens that may follow each context, and ``probs`` (n_contexts, branching) float64,
    their probabilities (normalised standard exponentials: exactly a Dirichlet(1.0) per context).
    A context is ``latest`` for order 1 and ``earlier * vocab + latest`` for order 2; after token y
    the context (a, b) becomes (b, y).

    **Irreducible and aperiodic by construction.** A random cycle through all tokens (a seeded
    permutation) is fixed first: every context whose latest token is b has ``cycle[b]`` among its
    successors, so from any context the chain reaches the contexts (b, cycle[b]) within one step and
    walks through every token; and every context whose latest token is 0 has 0 among its successors
    (a self-loop on (0, 0), or on 0 for order 1), which makes the period 1. The other successors are
    a uniform random set of distinct tokens. So there is exactly one closed class (contexts outside it,
    if any, have stationary probability 0), the stationary distribution is unique and power
    iteration converges to it from the uniform start.
    """

    def __init__(self, vocab: int, order: int = 1, branching: int = 4, seed: int = 0):
        if order not in (1, 2):
            raise ValueError(f"Markov source: order must be 1 or 2, not {order}")
        if vocab < 2:
            raise ValueError(f"Markov source: vocab must be at least 2, not {vocab}")
        if not 2 <= branching <= vocab:
            raise ValueError(f"Markov source: branching must be in 2..vocab ({vocab}), not {branching}")
        self.vocab, self.order, self.branching, self.seed = int(vocab), int(order), int(branching), int(seed)
        v, b = self.vocab, self.branching
        n = self.n_contexts = v ** order
        rng = np.random.default_rng([seed_key(seed), _TAG_STRUCTURE])
        perm = rng.permutation(v)
        cycle = np.empty(v, np.int64)
        cycle[perm] = np.roll(perm, -1)  # perm[i] -> perm[i + 1]: one cycle through every token
        latest = np.arange(n) % v
        fixed_a = cycle[latest]  # every context: the cycle's next token
        succ = np.empty((n, b), np.int64)
        # Contexts whose latest token is not 0: the cycle's token plus b - 1 others, distinct.
        rows = latest != 0
        r = _distinct(rng, int(rows.sum()), b - 1, v - 1)
        succ[rows, 0] = fixed_a[rows]
        succ[rows, 1:] = r + (r >= fixed_a[rows, None])  # skip the fixed token
        # Contexts whose latest token is 0: the cycle's token, 0 itself (cycle[0] != 0), b - 2 others.
        rows0 = ~rows
        lo, hi = 0, int(cycle[0])  # sorted, as the skipping below needs
        r = _distinct(rng, int(rows0.sum()), b - 2, v - 2)
        r = r + (r >= lo)
        r = r + (r >= hi)
        succ[rows0, 0], succ[rows0, 1] = hi, lo
        succ[rows0, 2:] = r
        probs = rng.standard_exponential((n, b))
        probs /= probs.sum(axis=1, keepdims=True)
        self.successors, self.probs = succ, probs
        # The context after each successor, flat: the sparse transition matrix over contexts.
        self._next = (latest[:, None] * v + succ) if order == 2 else succ
        self._cum = np.cumsum(probs, axis=1)
        self._stationary: np.ndarray | None = None

    def _step(self, ctx: np.ndarray, u: np.ndarray) -> np.ndarray:
        """The successor token of each context ``ctx`` for uniforms ``u`` (inverse CDF)."""
        j = (u[:, None] >= self._cum[ctx]).sum(axis=1)
        return self.successors[ctx, np.minimum(j, self.branching - 1)]

    def stationary(self) -> np.ndarray:
        """(n_contexts,) float64: the stationary distribution over contexts (for order 2, over pairs
        (earlier, latest) of consecutive tokens, at ``earlier * vocab + latest``). Power iteration on
        the sparse transitions from the uniform distribution until the L1 change and the error it implies
        are below 1e-13 (plain steps, then lazy ones; see ``_TOL``); ValueError if the step cap is
        reached first. Computed once, then cached."""
        if self._stationary is None:
            n = self.n_contexts
            dest = self._next.ravel()
            cap = int(min(_MAX_ITER, max(_MIN_ITER, _MAX_WORK // dest.size)))
            pi, prev = np.full(n, 1.0 / n), np.inf
            for step in range(cap):
                new = np.bincount(dest, weights=(pi[:, None] * self.probs).ravel(), minlength=n)
                if step >= _PLAIN:
                    new = 0.5 * (new + pi)
                new /= new.sum()
                delta = np.abs(new - pi).sum()
                pi = new
                if delta < _TOL and delta < prev and delta * delta < _TOL * (prev - delta):
                    break
                prev = delta
            else:
                raise ValueError(f"Markov source (vocab {self.vocab}, order {self.order}, branching "
                                 f"{self.branching}, seed {self.seed}): the stationary distribution did not "
                                 f"converge in {cap} steps of power iteration")
            self._stationary = pi
        return self._stationary

    def entropy_rate(self) -> float:
        """The exact entropy rate in nats: sum over contexts c of stationary(c) * H(next token | c)."""
        return float(self.stationary() @ _entropy(self.probs))

    def _first_conditional(self) -> np.ndarray:
        """Order 2: (vocab, vocab) P(x1 = y | x0 = a) under stationarity, the model's best guess at
        position 0, where the token before x0 is unseen. The stationary pair distribution is the
        joint of (x0, x1) (stationarity), so this is that joint over its row sums."""
        joint = self.stationary().reshape(self.vocab, self.vocab)
        rows = joint.sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(rows > 0, joint / rows, 0.0)

    def floor(self, length: int) -> float:
        """The exact expected loss per position (nats) of the Bayes-optimal causal predictor that reads
        ``x[:, :length]`` and predicts ``x[:, 1:length + 1]``, the mean over the ``length`` positions.
        Order 1: every position has seen its context, so this is ``entropy_rate()``. Order 2: position
        0 has seen one token, so its term is H(X1 | X0) under stationarity (at least the entropy rate);
        the other ``length - 1`` terms are ``entropy_rate()``."""
        if length < 1:
            raise ValueError(f"Markov source: floor needs length >= 1, not {length}")
        rate = self.entropy_rate()
        if self.order == 1:
            return rate
        joint = self.stationary().reshape(self.vocab, self.vocab)
        first = float(_entropy(joint.ravel()) - _entropy(joint.sum(axis=1)))  # H(X0, X1) - H(X0)
        return (first + (length - 1) * rate) / length

    def nll(self, x: np.ndarray) -> np.ndarray:
        """(N, L) float64: for token sequences ``x`` (N, L + 1), the negative log-likelihood of the true
        model predicting ``x[:, t + 1]`` from ``x[:, :t + 1]``: -log P(x[t+1] | context at t). Order 2
        at position 0 uses P(x1 | x0), the marginal over the unseen earlier token, as ``floor`` does;
        so the mean over many samples of ``sample(N, L + 1, s)`` approaches ``floor(L)``. A transition
        the source never makes gives inf."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] < 2:
            raise ValueError(f"Markov source: nll needs sequences (N, L + 1) with L >= 1, not {x.shape}")
        if x.size and (x.min() < 0 or x.max() >= self.vocab):
            raise ValueError(f"Markov source: tokens must be in 0..{self.vocab - 1}")
        x = x.astype(np.int64)
        out = np.empty((x.shape[0], x.shape[1] - 1))
        start = self.order - 1  # order 2: position 0 is special
        if start:
            p0 = self._first_conditional()[x[:, 0], x[:, 1]]
            with np.errstate(divide="ignore"):
                out[:, 0] = -np.log(p0)
        ctx = x[:, start:-1]
        if self.order == 2:
            ctx = x[:, :-2] * self.vocab + ctx
        y = x[:, start + 1:]
        p = (self.probs[ctx] * (self.successors[ctx] == y[..., None])).sum(axis=-1)
        with np.errstate(divide="ignore"):
            out[:, start:] = -np.log(p)
        return out

    def sample(self, n_sequences: int, length: int, stream: int) -> np.ndarray:
        """(n_sequences, length) int32: sequences of the chain, each starting from a context drawn from
        ``stationary()`` (the first token, or for order 2 the first two), so every position is
        distributed as the stationary chain. Deterministic in (seed, stream): sequences are drawn in
        blocks of 1,024, each block from its own random stream, one uniform per sequence per step, so
        sequence i never depends on ``n_sequences`` and a shorter ``length`` gives a prefix."""
        if n_sequences < 0 or length < 1 or stream < 0:
            raise ValueError("Markov source: sample needs n_sequences >= 0, length >= 1 and stream >= 0, "
                             f"not {n_sequences}, {length}, {stream}")
        v = self.vocab
        cdf = np.cumsum(self.stationary())
        out = np.empty((n_sequences, length), np.int32)
        for lo in range(0, n_sequences, _BLOCK):
            m = min(_BLOCK, n_sequences - lo)
            rng = np.random.default_rng([seed_key(self.seed), _TAG_SAMPLE, stream, lo // _BLOCK])
            u = rng.random(_BLOCK)[:m] * cdf[-1]
            ctx = np.minimum(np.searchsorted(cdf, u, side="right"), self.n_contexts - 1)
            if self.order == 1:
                out[lo:lo + m, 0] = ctx
                t0 = 1
            else:
                out[lo:lo + m, 0] = ctx // v
                if length > 1:
                    out[lo:lo + m, 1] = ctx % v
                t0 = 2
            for t in range(t0, length):
                y = self._step(ctx, rng.random(_BLOCK)[:m])
                out[lo:lo + m, t] = y
                ctx = (ctx % v) * v + y if self.order == 2 else y
        return out


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """Entropy in nats of the empirical token frequencies of ``tokens`` (any shape, values in
    0..vocab-1): the best loss of a model that ignores context, the "chance" level for tokens."""
    t = np.asarray(tokens).ravel()
    if t.size == 0:
        raise ValueError("unigram entropy of no tokens")
    if t.min() < 0 or t.max() >= vocab:
        raise ValueError(f"unigram entropy: tokens must be in 0..{vocab - 1}")
    counts = np.bincount(t.astype(np.int64), minlength=vocab)
    return float(_entropy(counts / t.size))


# --- text ------------------------------------------------------------------------------------------

def byte_tokens(text: str) -> np.ndarray:
    """The UTF-8 bytes of ``text`` as int32 tokens (vocab 256): one token per byte, so a non-ASCII
    character is 2 to 4 tokens."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def read_text(path: Union[str, Path]) -> str:
    """The text of one UTF-8 file, or of every file under a folder.

    A folder is read recursively, its files sorted by path relative to it (POSIX form, code-point
    order), skipping hidden files and folders (a name starting with ``.``, such as ``.git``) and
    symbolic links to folders. A file that is not valid UTF-8 (binary, or another encoding) is skipped
    whole, never decoded in part or with replacement characters. The files' texts are concatenated,
    each followed by a newline if it does not end with one. A single file named directly must be
    valid UTF-8. ValueError, naming the path, when the path is missing or no non-empty UTF-8 text is
    found."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"text data: {root} does not exist")
    if root.is_file():
        try:
            text = root.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text data: {root} is not valid UTF-8 (byte {e.start})") from None
        if not text:
            raise ValueError(f"text data: {root} is empty")
        return text
    files = sorted((p for p in root.rglob("*")
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    parts, skipped = [], 0
    for p in files:
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if text:
            parts.append(text if text.endswith("\n") else text + "\n")
    if not parts:
        raise ValueError(f"text data: no UTF-8 text in {root} ({len(files)} files, {skipped} not UTF-8)")
    return "".join(parts)


def bpe_tokens(text: str, vocab_size: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """Train a byte-level BPE with ``vocab_size`` tokens on ``text`` and encode ``text`` with it:
    (int32 ids, the actual vocab size, at most ``vocab_size``; less when the text has too few pairs
    to merge). GPT-2's byte-level scheme: the 256 byte symbols are always in the vocab (ids 0..255,
    ordered by GPT-2's printable stand-ins for the bytes, not by byte value), the text is pre-split
    by GPT-2's regex without a prefix space, no special tokens, and the whole text is one training
    and encoding input (merges may cross lines).
    Deterministic: the ``tokenizers`` BPE trainer has no randomness (its alphabet is sorted and ties
    between pair counts are broken by token ids), so the same text gives the same ids in any process;
    ``seed`` is accepted so that every dataset takes one, and changes nothing. ImportError with the
    install hint when ``tokenizers`` is missing."""
    del seed  # nothing random to seed
    if vocab_size < 256:
        raise ValueError(f"byte-level BPE: vocab_size must be at least 256 (the bytes), not {vocab_size}")
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError("a BPE vocabulary (vocab above 256) needs the tokenizers library: "
                          "pip install 'benchbackend[text]'") from e
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    ids = np.asarray(tok.encode(text).ids, np.int32)
    return ids, int(tok.get_vocab_size())


def windows(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut a 1-D token stream into non-overlapping windows: x (N, context) and y (N, context) with
    x[i, t] = ids[i * context + t] and y[i, t] = ids[i * context + t + 1] (y is x shifted by one),
    N = (len(ids) - 1) // context; the tokens after the last whole window are dropped. ValueError
    when the stream holds less than one window (context + 1 tokens)."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"windows: token stream must be 1-D, not {ids.shape}")
    if context < 1:
        raise ValueError(f"windows: context must be at least 1, not {context}")
    n = (len(ids) - 1) // context
    if n < 1:
        raise ValueError(f"windows: {len(ids)} tokens hold no window of context {context} "
                         f"(needs {context + 1})")
    return ids[:n * context].reshape(n, context), ids[1:n * context + 1].reshape(n, context)


def split_by_position(ids: np.ndarray, validation_fraction: float, test_fraction: float, *,
                      context: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split a 1-D token stream by position into (train, validation, test): train is the first
    part, then validation, then test, no token in two (so no window straddles two splits). The
    validation and test parts hold floor(len * fraction) tokens each; train the rest. ValueError
    when a split would hold less than one window of ``context`` (context + 1 tokens, see
    ``windows``); a split whose fraction is 0 is empty on purpose and allowed."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"split: token stream must be 1-D, not {ids.shape}")
    if not (0 <= validation_fraction < 1 and 0 <= test_fraction < 1
            and validation_fraction + test_fraction < 1):
        raise ValueError(f"split: fractions must be in [0, 1) and sum below 1, not "
                         f"{validation_fraction} and {test_fraction}")
    n = len(ids)
    n_val, n_test = int(n * validation_fraction), int(n * test_fraction)
    n_train = n - n_val - n_test
    for name, size, fraction in (("train", n_train, 1.0), ("validation", n_val, validation_fraction),
                                 ("test", n_test, test_fraction)):
        if fraction > 0 and size < context + 1:
            raise ValueError(f"split: {n} tokens leave {size} for {name}, less than one window of context "
                             f"{context} ({context + 1} tokens)")
    return ids[:n_train], ids[n_train:n_train + n_val], ids[n_train + n_val:]
