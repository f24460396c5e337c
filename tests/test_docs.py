"""The docs site (docs/*.md): every ```python block runs, and ``mkdocs build --strict`` passes.

Conventions (stated on the docs' first guide page too):

* ```python blocks are executed, in order, one namespace per page. A block with ``>>>`` lines is a
  doctest (its printed output must match); any other python block is executed as a script.
* A block may be skipped only by a marker line as its first line, with a reason:
  ``# docs-test: requires torch, dp_accounting`` (skipped when one of those cannot be imported) or
  ``# docs-test: skip -- REASON``. A marker without a reason is an error.
* ```console blocks (shell commands) are shown for reading and are never run; any other fence
  language must be one of ``NOT_RUN`` so that a typo (``pyhton``, ``py``) cannot hide a block.
"""

from __future__ import annotations

import doctest
import importlib.util
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FENCE = re.compile(r"^( *)```([\w-]*)[^\n]*\n(.*?)^\1```", flags=re.S | re.M)
NOT_RUN = {"console", "text", "toml", "yaml", "json", "http", "ini", "dockerfile"}
MARKER = re.compile(r"#\s*docs-test:\s*(.*)")


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, indentation (admonitions) removed."""
    out = []
    for m in FENCE.finditer(text):
        indent = len(m.group(1))
        body = "\n".join(line[indent:] for line in m.group(3).splitlines()) + "\n"
        out.append((m.group(2), body))
    return out


def skip_reason(body: str) -> str | None:
    """Why a block is skipped (its marker line), or None when it must run."""
    first = body.lstrip("\n").splitlines()[0] if body.strip() else ""
    m = MARKER.match(first.strip())
    if m is None:
        return None
    rule = m.group(1).strip()
    if rule.startswith("requires"):
        mods = [x.strip() for x in rule.removeprefix("requires").split(",") if x.strip()]
        if not mods:
            raise AssertionError(f"docs-test marker without modules: {first!r}")
        missing = [x for x in mods if importlib.util.find_spec(x) is None]
        return f"needs {', '.join(missing)}" if missing else None
    if rule.startswith("skip") and len(rule.removeprefix("skip").strip(" -:")) >= 10:
        return rule.removeprefix("skip").strip(" -:")
    raise AssertionError(f"docs-test marker needs 'requires MODULES' or 'skip -- REASON': {first!r}")


def test_pages_exist_and_are_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert len(PAGES) >= 15
    for page in PAGES:
        assert page.relative_to(DOCS).as_posix() in nav, f"{page} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_fence_languages_are_known(page: Path) -> None:
    langs = {lang for lang, _ in blocks(page.read_text(encoding="utf-8"))}
    assert langs <= NOT_RUN | {"python"}, f"{page}: unknown fence language(s) {langs - NOT_RUN}"


def run_page(page: Path) -> tuple[int, list[str]]:
    """Run a page's python blocks in order in one namespace; (blocks run, skip reasons).

    Raises AssertionError naming the page and block when a doctest fails; a script block's own
    exception propagates.
    """
    code = [body for lang, body in blocks(page.read_text(encoding="utf-8")) if lang == "python"]
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs: dict[str, object] = {"__name__": "__docs__"}
    ran, skipped = 0, []
    with warnings.catch_warnings():
        # pages show seeded (not private) examples on purpose; the warning is part of the text
        warnings.simplefilter("ignore")
        for i, body in enumerate(code):
            reason = skip_reason(body)
            if reason is not None:
                skipped.append(f"block {i}: {reason}")
                continue
            if ">>>" in body:
                test = parser.get_doctest(body, globs, f"{page.name} block {i}", str(page), 0)
                result = runner.run(test, clear_globs=False)
                globs.update(test.globs)  # DocTest copies its globals: carry names to the next block
                assert not result.failed, f"{page} block {i} failed (doctest output above)"
            else:
                exec(compile(body, f"{page} block {i}", "exec"), globs)
            ran += 1
    return ran, skipped


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_python_blocks_run(page: Path) -> None:
    ran, skipped = run_page(page)
    if not ran:
        pytest.skip("; ".join(skipped) or "no python block on this page")


def test_the_runner_fails_on_wrong_output_and_shares_names(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 2\n```\n\n```python\n>>> x + 1\n3\n\n```\n")
    assert run_page(page) == (2, [])  # the second block sees the first block's x
    page.write_text("```python\n>>> 1 + 1\n3\n\n```\n")
    with pytest.raises(AssertionError, match="block 0 failed"):
        run_page(page)
    page.write_text("```python\nraise RuntimeError('boom')\n```\n")
    with pytest.raises(RuntimeError, match="boom"):
        run_page(page)


def test_skip_markers_need_a_reason(tmp_path: Path) -> None:
    assert skip_reason("# docs-test: requires no_such_module_xyz\nimport x\n") == "needs no_such_module_xyz"
    assert skip_reason("# docs-test: requires json\nimport json\n") is None  # importable: it runs
    assert skip_reason("# docs-test: skip -- needs a GPU and a 7B model\n") == "needs a GPU and a 7B model"
    with pytest.raises(AssertionError):
        skip_reason("# docs-test: skip\n")
    with pytest.raises(AssertionError):
        skip_reason("# docs-test: requires\n")


DOCUMENT_NUMBER = re.compile(r"\b[Dd]ocuments?\s+(?:\d{3}\s+(?:and|or)\s+)?00\d")


def user_facing_files() -> list[Path]:
    """What users read: the docs pages, README, every module (docstrings, CLI help) and static page."""
    src = ROOT / "src"
    static = [p for d in src.rglob("static") if d.is_dir() for p in d.rglob("*") if p.is_file()]
    return [*PAGES, ROOT / "README.md", *sorted(src.rglob("*.py")), *static]


def test_no_internal_document_numbers() -> None:
    # users read use cases ("the private inference server"); the numbered source documents the
    # project was specified from are not something they have
    files = user_facing_files()
    assert any(p.suffix == ".js" for p in files) and len(files) > 100  # the scan sees src and static
    hits = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in DOCUMENT_NUMBER.finditer(text):
            hits.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    assert not hits, "internal document numbers in user-facing text:\n" + "\n".join(hits)


def test_the_document_number_check_catches_each_form() -> None:
    for bad in ("document 000", "Document 004's API", "documents 003 and 004", "document\n002"):
        assert DOCUMENT_NUMBER.search(bad), bad
    for ok in ("Document000", "the private inference server", "document 1000 rows"):
        assert not DOCUMENT_NUMBER.search(ok), ok


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs the dev extra (mkdocs)")
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "accounting" / "index.html").stat().st_size > 10_000
