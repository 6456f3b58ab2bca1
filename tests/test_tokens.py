"""benchbackend.data.tokens: the Markov source's exact entropy rate and floor against brute force and
samples, its streams, and the text side (reading, bytes, BPE, windows, splits) on real text."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchbackend.data import tokens as tk

STDLIB_TEXT = Path(json.__file__).parent  # Python's own json package: real UTF-8 text on every machine


def dense_transitions(m: tk.MarkovSource) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: (contexts x contexts) transition matrix and (contexts x vocab) next-token table,
    built element by element from the sparse structure."""
    n, v = m.n_contexts, m.vocab
    ctx_to_ctx, next_token = np.zeros((n, n)), np.zeros((n, v))
    for c in range(n):
        for y, p in zip(m.successors[c], m.probs[c]):
            next_token[c, y] += p
            ctx_to_ctx[c, (c % v) * v + y if m.order == 2 else y] += p
    return ctx_to_ctx, next_token


def dense_stationary(ctx_to_ctx: np.ndarray) -> np.ndarray:
    w, vecs = np.linalg.eig(ctx_to_ctx.T)
    pi = np.real(vecs[:, np.argmin(np.abs(w - 1))])
    return pi / pi.sum()


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# --- the Markov source -----------------------------------------------------------------------------

@pytest.mark.parametrize("vocab, order, branching, seed", [(6, 1, 3, 0), (9, 1, 2, 4), (5, 2, 3, 1), (7, 2, 2, 3)])
def test_entropy_rate_matches_brute_force(vocab, order, branching, seed):
    m = tk.MarkovSource(vocab, order, branching, seed)
    ctx_to_ctx, next_token = dense_transitions(m)
    pi = dense_stationary(ctx_to_ctx)
    np.testing.assert_allclose(m.stationary(), pi, atol=1e-10)
    rate = sum(pi[c] * entropy(next_token[c]) for c in range(m.n_contexts))
    assert m.entropy_rate() == pytest.approx(rate, abs=1e-10)
    assert 0 < m.entropy_rate() < np.log(branching)


@pytest.mark.parametrize("order", [1, 2])
def test_chain_is_irreducible_and_aperiodic(order):
    """One eigenvalue of modulus 1 (a unique stationary distribution, period 1), every token reached."""
    for seed in range(5):
        m = tk.MarkovSource(5, order, 2, seed)
        ctx_to_ctx, _ = dense_transitions(m)
        moduli = np.abs(np.linalg.eigvals(ctx_to_ctx))
        assert (moduli > 1 - 1e-9).sum() == 1, seed
        tokens = m.stationary().reshape(-1, 5).sum(axis=0) if order == 2 else m.stationary()
        assert (tokens > 0).all(), seed


def test_structure_is_seeded_sparse_and_distinct():
    m = tk.MarkovSource(512, 2, 4, seed=0)  # the largest size the workloads use: 262,144 contexts
    assert m.successors.shape == m.probs.shape == (512 * 512, 4)
    ordered = np.sort(m.successors, axis=1)
    assert (np.diff(ordered, axis=1) > 0).all() and ordered.min() >= 0 and ordered.max() < 512
    np.testing.assert_allclose(m.probs.sum(axis=1), 1.0)
    pi = m.stationary()
    assert pi.shape == (512 * 512,) and pi.sum() == pytest.approx(1.0) and pi.min() >= 0
    assert 0 < m.entropy_rate() < np.log(4)
    small = tk.MarkovSource(20, 1, 4, seed=7)
    again, other = tk.MarkovSource(20, 1, 4, seed=7), tk.MarkovSource(20, 1, 4, seed=8)
    np.testing.assert_array_equal(small.successors, again.successors)
    np.testing.assert_array_equal(small.probs, again.probs)
    assert not np.array_equal(small.probs, other.probs)


@pytest.mark.parametrize("kwargs", [dict(vocab=8, order=3), dict(vocab=8, branching=1), dict(vocab=4, branching=5),
                                    dict(vocab=1, branching=1)])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError, match="Markov source"):
        tk.MarkovSource(**kwargs)


@pytest.mark.parametrize("order", [1, 2])
def test_nll_mean_approaches_floor(order):
    """Over 4,000 sequences, the true model's mean loss is within 4 standard errors of floor(L) (the
    error from per-sequence means, which are independent); for order 2, position 0 alone matches
    floor(1) = H(X1 | X0), far from the entropy rate."""
    m = tk.MarkovSource(16, order, 3, seed=1)
    length = 48
    loss = m.nll(m.sample(4000, length + 1, stream=0))
    assert loss.shape == (4000, length) and np.isfinite(loss).all()
    per_seq = loss.mean(axis=1)
    se = per_seq.std() / np.sqrt(len(per_seq))
    assert abs(per_seq.mean() - m.floor(length)) < 4 * se
    first = loss[:, 0]
    se0 = first.std() / np.sqrt(len(first))
    assert abs(first.mean() - m.floor(1)) < 4 * se0
    if order == 1:
        assert m.floor(1) == m.floor(length) == m.entropy_rate()
    else:
        assert m.floor(1) - m.entropy_rate() > 20 * se0  # the test tells the two apart
        assert m.floor(1) > m.floor(length) > m.entropy_rate()
        expected = (m.floor(1) + (length - 1) * m.entropy_rate()) / length
        assert m.floor(length) == pytest.approx(expected)


def test_nll_of_an_impossible_transition_is_inf_and_bad_input_refused():
    m = tk.MarkovSource(6, 1, 2, seed=0)
    never = next(y for y in range(6) if y not in m.successors[0])
    loss = m.nll(np.array([[0, never], [0, m.successors[0, 0]]]))
    assert np.isinf(loss[0, 0]) and np.isfinite(loss[1, 0])
    assert loss[1, 0] == pytest.approx(-np.log(m.probs[0, 0]))
    with pytest.raises(ValueError):
        m.nll(np.array([[0]]))
    with pytest.raises(ValueError):
        m.nll(np.array([[0, 6]]))
    with pytest.raises(ValueError):
        m.floor(0)


@pytest.mark.parametrize("order", [1, 2])
def test_sample_is_deterministic_and_a_prefix(order):
    m = tk.MarkovSource(12, order, 3, seed=2)
    a = m.sample(1100, 30, stream=5)  # past one block of 1,024 sequences
    assert a.shape == (1100, 30) and a.dtype == np.int32 and a.min() >= 0 and a.max() < 12
    np.testing.assert_array_equal(a, m.sample(1100, 30, stream=5))
    np.testing.assert_array_equal(a[:7, :12], m.sample(7, 12, stream=5))  # fewer and shorter: a prefix
    np.testing.assert_array_equal(a[:, :1], m.sample(1100, 1, stream=5))
    np.testing.assert_array_equal(a[1030:], m.sample(2100, 30, stream=5)[1030:1100])
    assert (a != m.sample(1100, 30, stream=6)).mean() > 0.5
    assert (a != tk.MarkovSource(12, order, 3, seed=3).sample(1100, 30, stream=5)).mean() > 0.5
    assert np.isfinite(m.nll(a)).all()  # every transition is one the source makes
    assert m.sample(0, 5, stream=0).shape == (0, 5)


def test_sample_positions_follow_the_stationary_distribution():
    m = tk.MarkovSource(6, 1, 3, seed=4)
    x = m.sample(20000, 8, stream=0)
    pi = m.stationary()
    for t in (0, 7):
        freq = np.bincount(x[:, t], minlength=6) / len(x)
        se = np.sqrt(pi * (1 - pi) / len(x))
        assert (np.abs(freq - pi) < 5 * se + 1e-12).all(), t


def test_unigram_entropy_of_known_distributions():
    assert tk.unigram_entropy(np.array([0, 0, 1, 1]), 4) == pytest.approx(np.log(2))
    assert tk.unigram_entropy(np.array([[3, 3], [3, 1]]), 4) == pytest.approx(-(0.75 * np.log(0.75)
                                                                                 + 0.25 * np.log(0.25)))
    assert tk.unigram_entropy(np.arange(256) % 8, 8) == pytest.approx(np.log(8))
    assert tk.unigram_entropy(np.zeros(5, np.int32), 3) == 0.0
    with pytest.raises(ValueError):
        tk.unigram_entropy(np.array([0, 4]), 4)
    m = tk.MarkovSource(16, 1, 3, seed=0)  # context helps: the rate is well below the unigram entropy
    assert m.entropy_rate() < tk.unigram_entropy(m.sample(500, 64, 0), 16) - 0.5


# --- text ------------------------------------------------------------------------------------------

def test_byte_tokens_of_non_ascii_text():
    ids = tk.byte_tokens("aé€😀\n")
    assert ids.dtype == np.int32
    assert ids.tolist() == [0x61, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0x0A]
    assert bytes(ids.astype(np.uint8)).decode("utf-8") == "aé€😀\n"


def test_read_text_folder_order_and_skips(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first é\n", encoding="utf-8")
    (tmp_path / "sub" / "c.txt").write_text("third\n", encoding="utf-8")
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".hidden").write_text("hidden\n")
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert tk.read_text(tmp_path) == "first é\nsecond\nthird\n"
    assert tk.read_text(str(tmp_path / "b.txt")) == "second"


def test_read_text_refusals_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="does not exist") as e:
        tk.read_text(missing)
    assert str(missing) in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.dat").write_bytes(b"\xff\xfe\xfd")
    with pytest.raises(ValueError, match="no UTF-8 text") as e:
        tk.read_text(tmp_path / "bin")
    assert str(tmp_path / "bin") in str(e.value) and "1 not UTF-8" in str(e.value)
    with pytest.raises(ValueError, match="not valid UTF-8") as e:
        tk.read_text(tmp_path / "bin" / "x.dat")
    assert str(tmp_path / "bin" / "x.dat") in str(e.value)


def test_read_text_of_the_standard_library():
    text = tk.read_text(STDLIB_TEXT)  # its __pycache__'s .pyc files are skipped as not UTF-8
    assert "def dumps(" in text and "class JSONDecoder" in text
    assert text.index("def dumps(") < text.index("class JSONDecoder")  # __init__.py before decoder.py


def test_windows_shift_by_one():
    ids = np.arange(100, 111)  # 11 tokens
    x, y = tk.windows(ids, 3)
    np.testing.assert_array_equal(x, [[100, 101, 102], [103, 104, 105], [106, 107, 108]])
    np.testing.assert_array_equal(y, x + 1)
    x, y = tk.windows(np.arange(4), 3)
    assert x.tolist() == [[0, 1, 2]] and y.tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="no window"):
        tk.windows(np.arange(3), 3)
    with pytest.raises(ValueError):
        tk.windows(np.arange(12).reshape(3, 4), 2)


def test_split_by_position_sizes_and_order():
    ids = np.arange(1000)
    train, val, test = tk.split_by_position(ids, 0.1, 0.05)
    assert (len(train), len(val), len(test)) == (850, 100, 50)
    np.testing.assert_array_equal(np.concatenate([train, val, test]), ids)  # in order, no token twice
    train, val, test = tk.split_by_position(ids, 0.2, 0.0)
    assert (len(train), len(val), len(test)) == (800, 200, 0)
    assert len(tk.split_by_position(ids, 0.1, 0.1, context=99)[1]) == 100
    with pytest.raises(ValueError, match="validation"):
        tk.split_by_position(ids, 0.1, 0.1, context=100)  # 100 tokens hold no window of 100
    with pytest.raises(ValueError, match="test"):
        tk.split_by_position(np.arange(40), 0.5, 0.01)
    with pytest.raises(ValueError):
        tk.split_by_position(ids, 0.6, 0.5)


# --- BPE -------------------------------------------------------------------------------------------

_BPE_DIGEST = """
import hashlib, sys
from benchbackend.data import tokens as tk
ids, vocab = tk.bpe_tokens(tk.read_text(sys.argv[1]), 400)
print(hashlib.sha256(ids.tobytes()).hexdigest(), vocab)
"""


def test_bpe_on_standard_library_sources_is_deterministic():
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (the BPE option's library): "
                        "pip install 'benchbackend[text]'")
    text = tk.read_text(STDLIB_TEXT)
    ids, vocab = tk.bpe_tokens(text, 400)
    again, vocab_again = tk.bpe_tokens(text, 400, seed=3)
    assert ids.dtype == np.int32 and vocab == vocab_again == 400
    np.testing.assert_array_equal(ids, again)
    assert ids.min() >= 0 and ids.max() < vocab
    assert len(ids) < 0.7 * len(text.encode("utf-8"))  # merges compress the bytes
    # Another process (another Rust hash seed, another Python hash seed) gives the same ids.
    out = subprocess.run([sys.executable, "-c", _BPE_DIGEST, str(STDLIB_TEXT)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.split() == [hashlib.sha256(ids.tobytes()).hexdigest(), "400"]
    small, small_vocab = tk.bpe_tokens("abababab", 1000)  # too little text to fill the vocab
    assert 256 <= small_vocab < 1000 and small.max() < small_vocab
    with pytest.raises(ValueError, match="at least 256"):
        tk.bpe_tokens(text, 255)


def test_bpe_without_tokenizers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'benchbackend\[text\]'"):
        tk.bpe_tokens("some text", 300)
