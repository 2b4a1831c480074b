"""Pooling: one vector per prompt from the model's last hidden states (embeddings).

How a model pools (`PoolerConfig`), first found wins:

1. `--pooler-config '{"pooling_type": "MEAN", "normalize": true}'` (vLLM's keys; the type
   LAST, MEAN or CLS, any case);
2. the model folder's sentence-transformers files: `modules.json` naming a Pooling module
   (its `config.json`: `pooling_mode_lasttoken`, `pooling_mode_mean_tokens` or
   `pooling_mode_cls_token`) and,
   if it lists one, a Normalize module;
3. none: the model does not pool, and an embedding request for it is refused.

The types, over the final hidden states (after the last norm, before the LM head):

    last   the prompt's last position (decoder embedding models: Qwen3-Embedding, e5-mistral)
    mean   the mean over every prompt position (sentence-transformers' mean pooling)
    cls    the first position

`normalize`: the vector divided by its L2 norm. A request carries its pooling in its
`SamplingParams` (`pooling_type`, `pooling_normalize`), so it crosses every ring with the
sampling fields; the worker pools it when its prompt is computed and it finishes there,
with no token sampled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys, by the type they select
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type: {self.pooling_type!r} is not one of "
                f"{', '.join(t.upper() for t in POOLING_TYPES)}"
            )


def parse_pooler_config(text: str) -> PoolerConfig:
    """`--pooler-config` JSON -> PoolerConfig; ValueError naming what is wrong."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"pooler_config: not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(given, dict):
        raise ValueError(f"pooler_config: must be a JSON object, got {text!r}")
    unknown = set(given) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(
            f"pooler_config: unknown keys {sorted(unknown)}; known: pooling_type, normalize"
        )
    kind = given.get("pooling_type", "LAST")
    normalize = given.get("normalize", True)
    if not isinstance(kind, str):
        raise ValueError(f"pooler_config: pooling_type must be a string, got {kind!r}")
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    return PoolerConfig(kind.lower(), normalize)


def pooler_config_of(model_path: Path, override: str | None = None) -> PoolerConfig | None:
    """How the model pools (None: it does not); see the module docstring."""
    if override:
        return parse_pooler_config(override)
    modules_file = Path(model_path) / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{modules_file}: not a sentence-transformers modules list: {exc}"
        ) from None
    kind, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        name = str(module.get("type", "")) if isinstance(module, dict) else ""
        if name.endswith(".Pooling"):
            kind = _st_pooling_type(Path(model_path) / str(module.get("path", "")))
        elif name.endswith(".Normalize"):
            normalize = True
    return None if kind is None else PoolerConfig(kind, normalize)


def _st_pooling_type(folder: Path) -> str:
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_file}: the Pooling module's config: {exc}") from None
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    if len(chosen) != 1:
        modes = sorted(
            key for key, value in config.items() if key.startswith("pooling_mode") and value
        )
        raise ValueError(
            f"{config_file}: pools by {modes or 'no mode'}; ringllm pools by exactly one of "
            f"{sorted(_ST_MODES)}"
        )
    return chosen[0]
