"""The demo model's corpus: Python source installed on this machine, split by whole package.

Sources, each a *package* of the corpus:

- ``python-stdlib``: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except the folders in
  ``EXCLUDE`` (test suites, vendored, generated or demo code, caches and codec tables).
- every installed distribution (``importlib.metadata``) whose files lie in this interpreter's
  site-packages: its ``*.py`` files, except those under an ``EXCLUDE`` folder (tests, ``_vendor``...).

A file is skipped when it looks generated: over ``MAX_FILE_BYTES``, or more than 1% of its lines
longer than 200 characters, or more than a quarter of its bytes digits (tables). Files are deduplicated by the SHA-1 of their bytes: the first copy met
wins, with the validation packages met first, so no validation file is also trained on (``pip``'s
vendored ``rich``, say, is excluded by its folder anyway, and a copy of a held-out package under a
``VENDOR_DIRS`` folder of another package is left out whatever its version). A package gives at most ``PACKAGE_CAP``
bytes (files taken in the order of a hash of their path, so the sample spreads over the package);
the standard library is taken whole.

Validation is whole packages, ``VALIDATION_PACKAGES``, never trained on (``corpus()`` leaves them
out of the training split and any other package's copy of one of their files too).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import os
import platform
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EXCLUDE = {"test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip",
           "__pycache__", "pydoc_data", "encodings", "_vendor", "vendor", "vendored", "_vendored"}
# our own package is left out: the model must not learn the code that observes it
SKIP_PACKAGES = {"moe-workbench"}
VALIDATION_PACKAGES = ("attrs", "click", "jinja2", "requests", "rich")
# folders another package vendors third-party code in: a held-out package's copy there is never trained on,
# even when it is another version than the installed one (byte-equal copies are caught by the hash anyway)
VENDOR_DIRS = {"thirdparty", "third_party", "thirdparty_files", "extern", "externals"}
PACKAGE_CAP = 1_500_000
MAX_FILE_BYTES = 256_000
STDLIB = "python-stdlib"
_DIGIT = re.compile(rb"[0-9]")


def norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Package:
    name: str
    version: str
    licence: str
    split: str  # "train" or "validation"
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    skipped_generated: int = 0
    skipped_duplicate: int = 0
    skipped_cap: int = 0


def licence_of(dist: md.Distribution) -> str:
    """A short licence name from the metadata: License-Expression, a one-line License, or the classifiers."""
    meta = dist.metadata
    expr = (meta.get("License-Expression") or "").strip()
    if expr:
        return expr
    lic = (meta.get("License") or "").strip()
    if lic and "\n" not in lic and len(lic) <= 60 and lic.upper() != "UNKNOWN":
        return lic
    classes = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    classes = [c for c in classes if c != "OSI Approved"]
    if classes:
        return "; ".join(classes)
    return "see its metadata" if lic else "not stated"


def looks_generated(data: bytes) -> bool:
    if len(data) > MAX_FILE_BYTES:
        return True
    lines = data.split(b"\n")
    long_lines = sum(len(line) > 200 for line in lines) > 0.01 * len(lines)
    return long_lines or len(_DIGIT.findall(data)) > 0.25 * len(data)  # or mostly number tables


def _stdlib_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDE)
        out.extend(Path(dirpath) / n for n in sorted(filenames) if n.endswith(".py"))
    return out


def _site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()})


def _dist_files(dist: md.Distribution, roots: list[Path]) -> list[Path]:
    out = []
    for f in dist.files or []:
        if not str(f).endswith(".py") or EXCLUDE.intersection(Path(str(f)).parts[:-1]):
            continue
        path = Path(dist.locate_file(f)).resolve()
        if any(path.is_relative_to(r) for r in roots) and path.is_file():
            out.append(path)
    return out


def _order(name: str, path: Path) -> bytes:
    return hashlib.sha1(f"{name}/{path.name}/{path}".encode()).digest()


@functools.lru_cache(maxsize=4)
def corpus(cap: int = PACKAGE_CAP, validation: tuple[str, ...] = VALIDATION_PACKAGES) -> list[Package]:
    """Every source package with the files it gives (see the module docstring). Deterministic on a machine;
    computed once per process (it reads every candidate file)."""
    roots = _site_dirs()
    dists: dict[str, md.Distribution] = {}
    for d in md.distributions():
        name = norm(d.metadata["Name"] or "")
        if name and name not in SKIP_PACKAGES and name not in dists:
            dists[name] = d
    val = {norm(v) for v in validation}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources: list[tuple[Package, list[Path], int | None]] = []
    for name in sorted(dists, key=lambda n: (n not in val, n)):
        d = dists[name]
        files = sorted(_dist_files(d, roots), key=lambda p: _order(name, p))
        if files:
            pkg = Package(name, d.version, licence_of(d), "validation" if name in val else "train")
            sources.append((pkg, files, cap))
    # the stdlib after the validation packages, before the other packages: it keeps what they copied
    std = Package(STDLIB, platform.python_version(), "PSF-2.0", "train")
    n_val = sum(p.split == "validation" for p, _, _ in sources)
    sources.insert(n_val, (std, _stdlib_files(stdlib), None))
    held_names = {Path(str(f)).parts[0] for n in val if n in dists for f in dists[n].files or []
                  if str(f).endswith(".py")}  # the import names of the validation packages
    seen: set[bytes] = set()
    for pkg, files, limit in sources:
        for path in files:
            if pkg.split == "train" and VENDOR_DIRS & set(path.parts) and held_names & set(path.parts):
                pkg.skipped_duplicate += 1  # a vendored copy of a held-out package
                continue
            data = path.read_bytes()
            digest = hashlib.sha1(data).digest()
            if digest in seen:
                pkg.skipped_duplicate += 1
                continue
            if pkg.split == "validation":
                seen.add(digest)  # a held-out file left out below is still never trained on
            if looks_generated(data):
                pkg.skipped_generated += 1
                continue
            if limit is not None and pkg.bytes + len(data) > limit:
                pkg.skipped_cap += 1
                continue
            seen.add(digest)
            pkg.files.append(path)
            pkg.bytes += len(data)
    return [p for p, _, _ in sources if p.files]


def corpus_files(packages: list[Package] | None = None) -> tuple[list[Path], list[Path]]:
    """(train, validation) file lists."""
    packages = corpus() if packages is None else packages
    train = [f for p in packages if p.split == "train" for f in p.files]
    val = [f for p in packages if p.split == "validation" for f in p.files]
    return train, val
