"""Real English text of realistic lengths. None of it is generated.

Corpora (``CORPORA``):

- ``python-docs`` (the default; what every machine here has installed): the prose of
  Python's own reference documentation (``pydoc_data.topics``), the docstrings of the
  standard library (read from its source files, nothing imported) and the licence texts
  under ``/usr/share/common-licenses``. The detection defaults were chosen on it.
- ``kjv``: the King James Bible, chapter by chapter (Debian's ``bible-kjv``, read with
  its ``bible`` program): seventeenth-century English prose, unrelated to software.
- ``fortunes``: the English fortune cookies of Debian's ``fortunes`` (quotations,
  jokes, definitions, verse, literature), without the offensive or ASCII-art files.

The last two were never used to choose a default; ``apt-get install bible-kjv
fortunes`` brings them (the tests do not need them).

Requests follow a length mix like a model server's: mostly short (a sentence or two),
a quarter of a paragraph or so, and a long tail past 128 tokens. Each request is cut at
sentence boundaries from one passage (a passage runs on into the next when it is too
short), so it reads as text, not as a bag of words.

    from benchmarks.corpus import requests
    texts = requests(10_000, seed=0)
    bible = requests(50_000, seed=1, corpus="kjv")
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import numpy as np

#: share of requests in each length class (words) and its range: short, medium, long
LENGTHS = ((0.65, 4, 25), (0.25, 25, 90), (0.10, 90, 320))
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_CODE = re.compile(r"^\s*(>>>|\.\.\.|\$ |[{}\[\]()=#])|::\s*$|^\s{4,}\S")


def _prose(text: str) -> Iterator[str]:
    """Paragraphs of prose: code blocks, doctest lines and tables dropped, whitespace
    collapsed."""
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip() and not _CODE.search(line)]
        paragraph = " ".join(" ".join(lines).split())
        words = paragraph.split()
        letters = sum(c.isalpha() for c in paragraph)
        if len(words) >= 6 and letters > 0.7 * len(paragraph.replace(" ", "")):
            yield paragraph


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


@cache
def passages() -> tuple[str, ...]:
    """Every paragraph of prose of the Python documentation corpus, in a fixed order."""
    import pydoc_data.topics

    found: list[str] = []
    for _, text in sorted(pydoc_data.topics.topics.items()):
        found += _prose(text)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        for doc in _docstrings(path):
            found += _prose(doc)
    licences = Path("/usr/share/common-licenses")
    if licences.is_dir():
        for path in sorted(p for p in licences.iterdir() if p.is_file()):
            found += _prose(path.read_text(errors="replace"))
    return tuple(dict.fromkeys(found))  # each paragraph once


@cache
def kjv_chapters() -> tuple[str, ...]:
    """The King James Bible, one passage a chapter, in canonical order."""
    bible = shutil.which("bible")
    if bible is None:
        raise FileNotFoundError("the kjv corpus needs Debian's bible-kjv: apt-get install bible-kjv")
    out = subprocess.run([bible, "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    chapters: dict[str, list[str]] = {}
    for line in out.splitlines():
        ref, _, verse = line.partition(" ")
        if verse.strip():
            chapters.setdefault(ref.rsplit(":", 1)[0], []).append(verse.strip())
    return tuple(" ".join(" ".join(verses).split()) for verses in chapters.values())


FORTUNES = Path("/usr/share/games/fortunes")
#: fortune files left out: drawings, and text for translators
FORTUNES_SKIPPED = frozenset({"ascii-art", "translate-me"})


@cache
def fortune_cookies() -> tuple[str, ...]:
    """Debian's English fortune cookies, file by file, whitespace collapsed; attribution
    lines kept (they are text too)."""
    if not FORTUNES.is_dir():
        raise FileNotFoundError("the fortunes corpus needs Debian's fortunes: apt-get install fortunes")
    found: list[str] = []
    for path in sorted(p for p in FORTUNES.iterdir() if p.is_file() and not p.suffix):
        if path.name in FORTUNES_SKIPPED:
            continue
        for cookie in re.split(r"^%$", path.read_text(errors="replace"), flags=re.MULTILINE):
            text = " ".join(cookie.split())
            letters = sum(c.isalpha() for c in text)
            if len(text.split()) >= 3 and letters > 0.6 * len(text.replace(" ", "")):
                found.append(text)
    return tuple(dict.fromkeys(found))


CORPORA: dict[str, Callable[[], tuple[str, ...]]] = {
    "python-docs": passages, "kjv": kjv_chapters, "fortunes": fortune_cookies}


def requests(n: int, seed: int = 0, corpus: str = "python-docs") -> list[str]:
    """``n`` request texts of the length mix above, drawn with ``seed`` from ``corpus``
    (one of ``CORPORA``)."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; known: {sorted(CORPORA)}")
    rng = np.random.default_rng(seed)
    pool = CORPORA[corpus]()
    shares = np.array([share for share, _, _ in LENGTHS])
    out = []
    for kind in rng.choice(len(LENGTHS), size=n, p=shares / shares.sum()):
        _, low, high = LENGTHS[kind]
        want = int(np.exp(rng.uniform(np.log(low), np.log(high))))
        start = int(rng.integers(len(pool)))
        sentences: list[str] = []
        i = start
        while sum(len(s.split()) for s in sentences) < want and i < start + 50:
            sentences += _SENTENCE.split(pool[i % len(pool)])
            i += 1
        first = int(rng.integers(max(1, len(sentences) // 3)))
        text, words = [], 0
        for sentence in sentences[first:]:
            text.append(sentence)
            words += len(sentence.split())
            if words >= want:
                break
        out.append(" ".join(" ".join(text).split()[: max(want, 3) + 20]))
    return out


if __name__ == "__main__":
    import statistics
    import sys

    name = sys.argv[1] if len(sys.argv) > 1 else "python-docs"
    texts = requests(2000, corpus=name)
    words = [len(t.split()) for t in texts]
    print(f"{name}: {len(CORPORA[name]())} passages; 2,000 requests: words median {statistics.median(words):.0f}, "
          f"90th {sorted(words)[1800]}, max {max(words)}")
    for t in texts[:5]:
        print("-", t[:160])
