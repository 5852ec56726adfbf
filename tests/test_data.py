"""Corpora: the embedded Shakespeare, user text, a deterministic split by document, reproducible batches."""

import random

import pytest
import torch

from skewadam.data import decode, encode, eval_batches, get_batch, load_corpus, read_documents, split_documents


def test_shakespeare_validation_plays_are_pinned():
    """Every run on every machine validates on the same plays (the split hashes names only)."""
    corpus = load_corpus()
    assert corpus.val_docs == ("comedies/as-you-like-it.md", "histories/henry-iv-part-1.md",
                               "histories/henry-vi-part-2.md", "tragedies/othello.md")
    assert len(corpus.train_docs) == 34 and not set(corpus.train_docs) & set(corpus.val_docs)
    assert corpus.train.dtype == torch.uint8 and corpus.train.numel() + corpus.val.numel() > 5_000_000


def test_split_is_independent_of_document_order_and_disjoint():
    docs = [(f"doc{i}.txt", f"text {i}") for i in range(25)]
    train, val = split_documents(docs, 0.1)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    assert split_documents(shuffled, 0.1) == (train, val)
    assert len(val) == 3 and len(train) == 22 and not {n for n, _ in train} & {n for n, _ in val}


def test_single_document_splits_by_position():
    train, val = split_documents([("a.txt", "x" * 90 + "y" * 10)], 0.1)
    assert train == [("a.txt[train]", "x" * 90)] and val == [("a.txt[val]", "y" * 10)]


def test_user_folder_reads_text_files_recursively(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub" / "b.md").write_text("beta " * 50)
    (tmp_path / "c.bin").write_bytes(b"\x00\x01")
    (tmp_path / "empty.txt").write_text("  \n")
    assert [n for n, _ in read_documents(tmp_path)] == ["a.txt", "sub/b.md"]
    corpus = load_corpus(tmp_path)
    assert corpus.val_docs + corpus.train_docs in (("a.txt", "sub/b.md"), ("sub/b.md", "a.txt"))


def test_missing_or_empty_data_path_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="text file or a folder"):
        read_documents(tmp_path / "nope")
    with pytest.raises(ValueError, match="no non-empty text files"):
        read_documents(tmp_path)


def test_bytes_round_trip_including_non_ascii():
    text = "O Romeo, Romeo! — wherefore art thou"
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and tokens.numel() == len(text.encode()) and int(tokens.max()) == 226
    assert decode(tokens) == text


def test_batches_are_reproducible_and_targets_are_shifted_inputs():
    data = encode("the quick brown fox jumps over the lazy dog " * 20)
    x1, y1 = get_batch(data, 4, 16, torch.Generator().manual_seed(3))
    x2, y2 = get_batch(data, 4, 16, torch.Generator().manual_seed(3))
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_eval_batches_are_fixed_and_cover_the_ends():
    data = encode("".join(chr(97 + i % 26) for i in range(1000)))
    batches = eval_batches(data, 3, 2, 10)
    assert len(batches) == 3 and all(x.shape == (2, 10) for x, _ in batches)
    assert torch.equal(batches[0][0][0], data[:10].long()) and torch.equal(batches[-1][1][-1], data[-10:].long())


def test_text_shorter_than_a_window_is_refused():
    with pytest.raises(ValueError, match="smaller --block-size"):
        get_batch(encode("short"), 1, 16, torch.Generator())
