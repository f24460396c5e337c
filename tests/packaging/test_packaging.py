"""Packaging: LICENSE shipped, metadata complete, torch extras accept a range, extras named when missing."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gaussdp._extras import EXTRAS, extra_installed, missing_modules, require_extra

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def test_license_file_is_the_apache_2_text_and_is_declared() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    assert PROJECT["license"] == "Apache-2.0"
    assert "LICENSE" in PROJECT["license-files"]


def test_metadata_has_authors_classifiers_and_urls() -> None:
    assert PROJECT["authors"] and all("name" in a for a in PROJECT["authors"])
    assert "Programming Language :: Python :: 3.11" in PROJECT["classifiers"]
    assert "Typing :: Typed" in PROJECT["classifiers"]
    # A license classifier beside an SPDX license expression is rejected by setuptools >= 77.
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]
    assert {"Homepage", "Source", "Issues"} <= set(PROJECT["urls"])


@pytest.mark.parametrize("extra", ["torch", "hf"])
def test_torch_extras_accept_a_range_of_versions(extra: str) -> None:
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    (torch,) = [r for r in reqs if r.name == "torch"]
    assert not any(s.operator == "==" for s in torch.specifier), torch
    for version in ("2.4.0", "2.13.0", "2.99"):
        assert torch.specifier.contains(version), (version, torch)
    assert not torch.specifier.contains("3.0")


def test_cryptography_is_a_core_dependency() -> None:
    # the default noise's ChaCha20 keystream (gaussdp.noise); without it the fallback is 4x slower.
    from packaging.requirements import Requirement

    names = {Requirement(r).name for r in PROJECT["dependencies"]}
    assert names == {"numpy", "scipy", "cryptography"}
    from gaussdp.noise import noise_source

    assert noise_source("secure").stream == "ChaCha20"  # type: ignore[attr-defined]


def test_extras_table_matches_pyproject() -> None:
    assert set(EXTRAS) <= set(PROJECT["optional-dependencies"])


def test_require_extra_names_the_extra_and_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gensim", None)  # find_spec sees it as absent
    assert missing_modules("text") == ["gensim"]
    assert not extra_installed("text")
    with pytest.raises(ImportError, match=r"pip install 'gaussdp\[text\]'") as info:
        require_extra("text", feature="reading word2vec files")
    assert info.value.name == "gensim"
    assert "reading word2vec files" in str(info.value)


def test_require_extra_rejects_an_unknown_extra() -> None:
    with pytest.raises(ValueError, match="unknown extra 'nope'"):
        require_extra("nope", feature="x")


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("gaussdp.torch", "torch", "torch"),
        ("gaussdp.inference", "torch", "torch"),
        ("gaussdp.finetune", "peft", "hf"),
        ("gaussdp.service.app", "fastapi", "service"),
        ("gaussdp.federated.flower", "flwr", "federated"),
    ],
)
def test_subpackage_without_its_extra_names_the_extra(module: str, blocked: str, extra: str) -> None:
    code = f"import sys; sys.modules[{blocked!r}] = None\nimport {module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"pip install 'gaussdp[{extra}]'" in proc.stderr, proc.stderr[-2000:]


def test_text_vocabulary_reader_names_the_text_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gaussdp.text import Vocabulary

    monkeypatch.setitem(sys.modules, "gensim", None)
    monkeypatch.setitem(sys.modules, "gensim.models", None)
    path = tmp_path / "v.txt"
    path.write_text("1 2\nword 0.1 0.2\n")
    with pytest.raises(ImportError, match=r"gaussdp\[text\]"):
        Vocabulary.from_word2vec(path)


def test_sdist_ships_the_license_and_the_c_kernel_source(tmp_path: Path) -> None:
    import shutil
    import tarfile

    # Build from a copy, so that the test leaves no egg-info behind in the checkout.
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, tree / name)
    dist = tmp_path / "dist"
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=300, check=True
    )

    name = proc.stdout.strip().splitlines()[-1]
    with tarfile.open(dist / name) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
        top = name.removesuffix(".tar.gz")
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()  # type: ignore[union-attr]
    assert {"LICENSE", "setup.py", "src/gaussdp/_gauss.c", "src/gaussdp/py.typed"} <= members
    assert "License-Expression: Apache-2.0" in pkg_info
    assert "License-File: LICENSE" in pkg_info
