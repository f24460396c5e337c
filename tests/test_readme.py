"""README.md's ```python blocks with ``>>>`` run as doctests: the tour's printed outputs are real."""

from __future__ import annotations

import doctest
import re
import warnings
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
DOCTEST_BLOCKS = [b for b in BLOCKS if ">>>" in b]


def test_readme_has_examples():
    assert DOCTEST_BLOCKS, "README.md should contain ```python blocks with >>> examples"


def test_readme_blocks():
    # Blocks share one namespace, in order, as a reader would run them.
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs: dict[str, object] = {}
    failed = []
    with warnings.catch_warnings():
        # The tour shows seeded (not private) examples on purpose; their warning is part of the text.
        warnings.simplefilter("ignore")
        for i, block in enumerate(DOCTEST_BLOCKS):
            test = parser.get_doctest(block, globs, f"README block {i}", str(README), 0)
            result = runner.run(test, clear_globs=False)
            globs.update(test.globs)  # DocTest copies its globals: carry names to the next block
            if result.failed:
                failed.append(i)
    assert not failed, f"README blocks {failed} failed (see the doctest output above)"
