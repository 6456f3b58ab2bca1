"""A language model's arrays, as every backend gets them: ``dataset: tokens`` (the workload's Markov
source) and ``dataset: text`` (the user's UTF-8 text), each as token windows whose labels are the
same windows shifted by one (``tokens.py`` holds the source and the tokenizers).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import DataError
from .datasets import Dataset
from .tokens import MarkovSource, bpe_tokens, byte_tokens, read_text, windows

if TYPE_CHECKING:
    from ..spec.workload import Workload


def token_sequences(workload: Workload) -> Dataset:
    """``dataset: tokens``: sequences of the workload's Markov source (``data/tokens.py``), one
    stream per split, each of ``context + 1`` tokens: x the first ``context`` (int32), the labels
    the same sequence shifted by one (int64, the next token at every position)."""
    spec = workload.data
    source = MarkovSource(spec.vocab, spec.order, spec.branching, workload.seed)
    parts = []
    for stream, n in enumerate((spec.train, spec.validation, spec.test)):
        seq = source.sample(n, spec.context + 1, stream)
        parts += [np.ascontiguousarray(seq[:, :-1], np.int32), np.ascontiguousarray(seq[:, 1:], np.int64)]
    return Dataset(*parts, source="synthetic")


def text_sequences(workload: Workload) -> Dataset:
    """``dataset: text``: the UTF-8 file or folder in ``path`` as token ids (its bytes at ``vocab``
    256; a byte-level BPE of ``vocab`` ids trained on it otherwise), cut into windows of ``context``
    tokens whose labels are shifted by one. Split by position: the training windows from the start
    (so ``--limit`` takes a prefix), validation and test from the end, test last. Raises
    ``DataError`` (one line naming the path) when the text is missing or too short."""
    spec = workload.data
    try:
        text = read_text(spec.path)
        if workload.num_classes == 256:
            ids = byte_tokens(text)
        else:
            ids = bpe_tokens(text, workload.num_classes, seed=workload.seed)[0]
    except ImportError as exc:
        raise DataError(f"{spec.path}: {exc}") from None
    except ValueError as exc:
        raise DataError(str(exc)) from None
    n = max((len(ids) - 1) // spec.context, 0)
    need = spec.train + spec.validation + spec.test
    if n < need:
        raise DataError(f"{spec.path}: {len(ids):,} tokens make {n:,} windows of {spec.context}; the workload needs "
                        f"train {spec.train} + validation {spec.validation} + test {spec.test} = {need:,} "
                        "(use --limit, or more text)")
    x, y = windows(ids, spec.context)
    x, y = x.astype(np.int32), y.astype(np.int64)
    val, test = slice(n - spec.test - spec.validation, n - spec.test), slice(n - spec.test, n)
    return Dataset(x[:spec.train].copy(), y[:spec.train].copy(), x[val].copy(), y[val].copy(), x[test].copy(),
                   y[test].copy(), source="text")


def load(workload: "Workload") -> Dataset:
    """A language model's arrays: its Markov source's (generated whatever ``--data`` says: the
    source is the dataset) or its text's."""
    return token_sequences(workload) if workload.data.dataset == "tokens" else text_sequences(workload)
