"""The demo model's corpus (model/corpus.py): whole packages held out, nothing of them trained on.

Runs on whatever this interpreter has installed, as ``workbench train`` does.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import pytest

from workbench.model import corpus as wc


@pytest.fixture(scope="module")
def packages() -> list[wc.Package]:
    return wc.corpus()


def test_validation_is_whole_packages_never_trained_on(packages):
    val = [p for p in packages if p.split == "validation"]
    train = [p for p in packages if p.split == "train"]
    assert len(val) >= 3 and {p.name for p in val} <= {wc.norm(n) for n in wc.VALIDATION_PACKAGES}
    assert len({p.name for p in packages}) == len(packages)  # a package is in one split only
    digest = lambda f: hashlib.sha1(f.read_bytes()).digest()  # noqa: E731
    val_hashes = {digest(f) for p in val for f in p.files}
    train_files = [f for p in train for f in p.files]
    assert not val_hashes & {digest(f) for f in train_files}  # no copy of a held-out file is trained on
    assert len(set(train_files)) == len(train_files)
    train_set, val_set = wc.corpus_files(packages)
    assert train_set == train_files and not set(train_set) & set(val_set)


def test_sources_are_the_stdlib_and_site_packages(packages):
    std = next(p for p in packages if p.name == wc.STDLIB)
    assert std.split == "train" and std.licence == "PSF-2.0"
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert all(f.resolve().is_relative_to(stdlib) for f in std.files)
    site = [Path(p).resolve() for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]
    others = [p for p in packages if p.name != wc.STDLIB]
    assert len(others) >= 20 and not {p.name for p in others} & wc.SKIP_PACKAGES
    for p in others:
        assert p.bytes <= wc.PACKAGE_CAP and p.licence and p.version, p.name
        assert p.bytes == sum(f.stat().st_size for f in p.files)
        for f in p.files:
            root = next((s for s in site if f.is_relative_to(s)), None)
            assert f.suffix == ".py" and root is not None, f
            assert not wc.EXCLUDE & set(f.relative_to(root).parts[:-1]), f  # no tests, vendored copies, caches


def test_generated_looking_files_are_skipped():
    code = b"def f(x):\n    return x + 1\n" * 100
    assert not wc.looks_generated(code)
    assert not wc.looks_generated(code + b"S = '" + b"ab" * 300 + b"'\n")  # one long line of 200
    assert wc.looks_generated(code + (b"S = '" + b"ab" * 300 + b"'\n") * 30)  # 30 of 230 lines long
    assert wc.looks_generated(b"T = [\n" + b"    (4352, 4447, 12345, 67890),\n" * 200 + b"]\n")  # number tables
    assert wc.looks_generated(code * 200)  # over MAX_FILE_BYTES
