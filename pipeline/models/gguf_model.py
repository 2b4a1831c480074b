"""A GGUF file served as it is: the small folder of text files beside it.

Everything above the weights reads a model folder: config.json (the architecture),
tokenizer.json / tokenizer_config.json / chat_template.jinja (the front end),
generation_config.json (stop ids). For a GGUF those come from its metadata, so
`gguf_view(path)` writes them once into a folder of the cache, with a `gguf.json` that
names the file; the weights stay in the GGUF (`gguf_weights.py` reads them from there).

    <cache>/gguf/<hash of path, size, mtime>/<file stem>/   (the folder's name is the model's name)
        gguf.json               {"file": "/abs/path/model.Q4_K_M.gguf", "size": ..., "mtime_ns": ...}
        config.json             gguf_config.build_hf_config
        generation_config.json  bos / eos (the eos id, eot / eom, end-of-turn control tokens)
        tokenizer.json, tokenizer_config.json, chat_template.jinja   gguf_tokenizer.py

`resolve_model_path(model)` is the folder every reader takes: an HF folder as given, a
GGUF's view. `is_gguf_model(path)`: a `.gguf` file, or a folder with no config.json holding exactly one
`.gguf` file. A changed file (size or mtime) gets a new view folder; a view is written into
a temporary folder and renamed into place, so processes racing to make it see either none
or a complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ringllm.pipeline.models.gguf_config import build_hf_config, generation_config, open_gguf
from ringllm.pipeline.models.gguf_tokenizer import write_hf_tokenizer

VIEW_FILE = "gguf.json"
_VIEW_VERSION = 2  # bump when what a view holds changes: old views are then rebuilt
# (2: gemma3 configs with their sliding window, SentencePiece tokenizers, the dtype of
# the file's dense matrices)


def resolve_model_path(model: str | None) -> Path:
    """The model's folder: an HF folder as given, or for a GGUF file (or a folder holding
    one) the view folder of its metadata (models/gguf_model.py)."""
    if model is None:  # the demo model's GGUF, as it is
        from ringllm.pipeline.models.demo_model import demo_gguf_path

        return gguf_view(demo_gguf_path())
    path = Path(model).expanduser()
    if is_gguf_model(path):
        return gguf_view(path)
    if path.is_file():
        raise ValueError(
            f"model {path} is a file but not a .gguf one; give a model folder (with its "
            "config.json) or a .gguf file"
        )
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {path} does not exist (models are loaded from local folders or .gguf "
            "files only)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"config.json is missing from the model folder {path} (and it holds no one .gguf "
            "file): it is not a model folder"
        )
    return path


def is_gguf_model(path: Path) -> bool:
    path = Path(path)
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and bool(_gguf_files(path))


def gguf_file_of(path: Path) -> Path:
    """The GGUF file `path` names: itself, or the one `.gguf` in a folder."""
    path = Path(path)
    if path.is_file():
        return path.resolve()
    files = _gguf_files(path)
    if len(files) != 1:
        raise ValueError(
            f"model folder {path} holds {len(files)} .gguf files "
            f"({', '.join(f.name for f in files)}); pass the path of the one to serve"
        )
    return files[0].resolve()


def gguf_view(path: Path, cache_dir: Path | None = None) -> Path:
    """The view folder of GGUF model `path` (made on first use; see the module docstring)."""
    from ringllm.pipeline.models.demo_model import resolve_cache_dir

    gguf_path = gguf_file_of(path)
    stat = gguf_path.stat()
    key = f"{_VIEW_VERSION}:{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    views = resolve_cache_dir(cache_dir) / "gguf"
    view = views / digest / gguf_path.stem
    if (view / VIEW_FILE).is_file():
        return view
    views.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest}.tmp-", dir=views))
    try:
        (staging / view.name).mkdir()
        _write_view(gguf_path, stat, staging / view.name)
        staging.chmod(0o755)
        try:
            os.rename(staging, view.parent)
        except OSError:
            if not (view / VIEW_FILE).is_file():  # not a racing writer's complete view
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return view


def view_gguf_file(folder: Path) -> Path | None:
    """The GGUF file a view folder stands for; None for any other folder. A view whose
    file changed or went is an error saying so."""
    marker = Path(folder) / VIEW_FILE
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    gguf_path = Path(info["file"])
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{folder} is the view of {gguf_path}, which no longer exists")
    stat = gguf_path.stat()
    if (stat.st_size, stat.st_mtime_ns) != (info["size"], info["mtime_ns"]):
        raise ValueError(
            f"{gguf_path} changed since its view {folder} was made; pass the .gguf path "
            "again (a new view is made for the new file)"
        )
    return gguf_path


# a dense matrix's type -> the dtype the view's config names (the one the model keeps
# such matrices in: models/linear.py weight_dtype)
_DENSE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def dense_matrix_dtype(reader) -> str:
    """The dtype of the file's dense (F32 / F16 / BF16) matrices, the most common one if
    they differ, so an F32 or F16 file's matrices are kept as the file has them; bfloat16
    for a file whose matrices are all blocks (where it names nothing that is kept)."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if len(tensor.shape) in (2, 3) and name in _DENSE_DTYPES:  # 3: experts
            counts[name] = counts.get(name, 0) + 1
    return _DENSE_DTYPES[max(counts, key=counts.get)] if counts else "bfloat16"


def _write_view(gguf_path: Path, stat: os.stat_result, out: Path) -> None:
    reader = open_gguf(gguf_path)
    config = build_hf_config(reader, dense_matrix_dtype(reader))
    write_hf_tokenizer(reader, out, config["max_position_embeddings"])
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(reader))
    marker = {"file": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _write_json(out / VIEW_FILE, marker)  # last: its presence means the view is complete
    out.chmod(0o755)


def _gguf_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
