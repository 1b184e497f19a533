"""Real English text of realistic lengths, from what every machine here has installed:
the prose of Python's own reference documentation (``pydoc_data.topics``), the
docstrings of the standard library (read from its source files, nothing imported) and
the licence texts under ``/usr/share/common-licenses``. None of it is generated.

Requests follow a length mix like a model server's: mostly short (a sentence or two),
a quarter of a paragraph or so, and a long tail past 128 tokens. Each request is cut at
sentence boundaries from one passage, so it reads as text, not as a bag of words.

    from benchmarks.corpus import requests
    texts = requests(10_000, seed=0)
"""

from __future__ import annotations

import ast
import re
import sysconfig
from collections.abc import Iterator
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
    """Every paragraph of prose found, in a fixed order."""
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


def requests(n: int, seed: int = 0) -> list[str]:
    """``n`` request texts of the length mix above, drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    pool = passages()
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

    texts = requests(2000)
    words = [len(t.split()) for t in texts]
    print(f"{len(passages())} passages; 2,000 requests: words median {statistics.median(words):.0f}, "
          f"90th {sorted(words)[1800]}, max {max(words)}")
    for t in texts[:5]:
        print("-", t[:160])
