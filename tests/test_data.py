"""Corpora: the embedded Shakespeare, user text, a deterministic split by document, reproducible batches."""

import os
import random
import re
import sys

import pytest
import torch

from skewadam.bench.data import decode, encode, eval_batches, get_batch, load_corpus, read_documents, split_documents


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


def test_a_folder_is_read_by_content_not_by_suffix(tmp_path):
    """Every UTF-8 text file is a document whatever its name; binary, non-UTF-8, empty and hidden files are counted."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "sub" / "b.py").write_text("def f():\n    return 'é'\n")
    (tmp_path / "Makefile").write_text("all:\n\techo ok\n")
    (tmp_path / "bom.c").write_bytes("\ufeffint main;".encode())
    (tmp_path / "image.txt").write_bytes(b"PNG\x00\x01text")  # a NUL byte: binary, whatever the suffix
    (tmp_path / "late.md").write_bytes(b"x" * 10_000 + b"\x00")  # past the first 8 KiB still counts
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / ".hidden").write_text("secret")
    docs, skipped = read_documents(tmp_path)
    assert [n for n, _ in docs] == ["Makefile", "a.txt", "bom.c", "sub/b.py"]
    assert dict(docs)["bom.c"] == "int main;" and dict(docs)["sub/b.py"].endswith("'é'\n")
    assert (skipped.binary, skipped.not_utf8, skipped.empty, skipped.hidden, skipped.folders) == (2, 1, 1, 1, 0)
    assert str(skipped) == "2 binary, 1 not UTF-8, 1 empty, 1 hidden"
    corpus = load_corpus(tmp_path)
    assert sorted(corpus.val_docs + corpus.train_docs) == ["Makefile", "a.txt", "bom.c", "sub/b.py"]
    assert corpus.describe().endswith("skipped 2 binary, 1 not UTF-8, 1 empty, 1 hidden")


def test_version_control_caches_and_installed_packages_are_not_entered(tmp_path):
    """A source tree's own text: .git, __pycache__ and site-packages below the root are not read, and counted."""
    for folder in (".git", "__pycache__", "lib/site-packages/pkg", "src"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "mod.py").write_text("x = 1\n")
    docs, skipped = read_documents(tmp_path)
    assert [n for n, _ in docs] == ["src/mod.py"] and skipped.folders == 3
    assert "3 folder(s) not entered" in str(skipped)
    assert [n for n, _ in read_documents(tmp_path / "lib" / "site-packages")[0]] == ["pkg/mod.py"]  # asked for


def test_a_source_tree_splits_by_document(tmp_path):
    """Source files are documents: the validation files are whole files, none of them seen in training."""
    for i in range(30):
        (tmp_path / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n" * 5)
    corpus = load_corpus(tmp_path, val_fraction=0.1)
    assert len(corpus.val_docs) == 3 and len(corpus.train_docs) == 27
    assert not set(corpus.val_docs) & set(corpus.train_docs)
    val_text = decode(corpus.val)
    assert all(f"def {n[:-3].replace('m', 'f')}()" in val_text for n in corpus.val_docs)


def test_missing_empty_or_binary_data_path_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist; give a text file or a folder"):
        read_documents(tmp_path / "nope")
    with pytest.raises(ValueError, match="no non-empty UTF-8 text files"):
        read_documents(tmp_path)
    (tmp_path / "data.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="no non-empty UTF-8 text files .skipped: 1 binary"):
        read_documents(tmp_path)
    with pytest.raises(ValueError, match="is binary, not text; give a UTF-8 text file"):
        read_documents(tmp_path / "data.bin")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8, not text; .*iconv"):
        read_documents(tmp_path / "latin1.txt")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs and /dev/null")
def test_a_data_path_that_is_no_file_or_folder_is_refused_naming_what_it_is(tmp_path):
    """Before any run (the bench's `RunConfig` checks it): a FIFO (reading it would block), a device, a symbolic
    link loop, a broken link, a missing path: each named, with the fix."""
    from skewadam.bench.config import RunConfig

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "broken").symlink_to(tmp_path / "gone")
    for path, what in ((tmp_path / "fifo", "is a FIFO (a named pipe), not a file or a folder"),
                       ("/dev/null", "is a device, not a file or a folder"),
                       (tmp_path / "loop1", "is a symbolic link loop"), (tmp_path / "broken", "is a broken symbolic link"),
                       (tmp_path / "nope", "does not exist")):
        for check in (read_documents, lambda data: RunConfig(data=str(data))):
            with pytest.raises(ValueError, match=re.escape(f"--data {str(path)!r} {what}") + ".*give a text file"):
                check(path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs")
def test_fifos_and_broken_or_looping_links_in_a_folder_are_skipped_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 50)
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "broken").symlink_to(tmp_path / "gone")
    docs, skipped = read_documents(tmp_path)
    assert [n for n, _ in docs] == ["a.txt"] and skipped.special == 4
    assert str(skipped) == "4 not a regular file (a FIFO, socket or device, or a broken or looping link)"


def test_a_one_byte_text_is_refused_as_shorter_than_a_window(tmp_path):
    """One document is split by position: one byte leaves no training text, which the window check names."""
    (tmp_path / "one.txt").write_text("x")
    corpus = load_corpus(tmp_path / "one.txt")
    assert corpus.train.numel() == 0 and corpus.train.dtype == torch.uint8 and encode("").numel() == 0
    with pytest.raises(ValueError, match=r"text of 0 tokens is shorter than block_size \+ 1 = 33; use more text"):
        get_batch(corpus.train, 1, 32, torch.Generator())


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
