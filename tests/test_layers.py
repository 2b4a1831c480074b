"""The package's layers: which folder may import which, and no circle between folders.

Every import statement of every module is read from its source (inside functions and
`if TYPE_CHECKING:` blocks too: a lazy import is still a dependency) and checked against
`ALLOWED`. The folders, by the process role that runs them (docs/architecture.md):

    ipc          the shared-memory transport: imports nothing of ringllm but itself
    cuda         CUDA kernels, the emulator, NCCL: the transport only
    structured   structured outputs' specs and the grammar backend: a leaf
    shared       ringllm.pipeline's own modules (config, sampling params, outputs, stats,
                 errors, child-process hygiene): types every role uses
    ops, models  the hot ops and the model code, used by the worker
    sample       the sampler, used by the worker
    core         scheduler, requests, KV cache manager (engine core process)
    worker       what runs inside one rank: model runner, input batch, loading (rank processes)
    executor     what drives the ranks: the executors, the rank process, hosts, batch records
    engine       the engine core, its process loop, its clients and wire records
    frontend     tokenizer, prompts, outputs, LLM / LLMEngine / AsyncLLM, Client
    facade       ringllm.pipeline itself (its lazy exports name the front end)
    server       the HTTP server;  tools: the CLI, benchmarks, model maker
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {"pipeline": "ringllm.pipeline", "ipc": "ringllm.ipc", "cuda": "ringllm.cuda"}
TOP |= {"server": "ringllm.server", "tools": "ringllm.tools"}
PIPELINE_FOLDERS = (
    "frontend",
    "engine",
    "executor",
    "core",
    "worker",
    "sample",
    "models",
    "ops",
    "structured",
)

ALLOWED = {
    "ipc": set(),
    "cuda": {"ipc"},
    "structured": set(),
    "shared": {"ipc", "structured"},
    "ops": {"shared", "cuda"},
    "models": {"ops", "shared"},
    "sample": {"ops", "shared"},
    "core": {"shared", "structured"},
    "worker": {"core", "models", "ops", "sample", "shared", "ipc", "cuda"},
    "executor": {"worker", "core", "models", "shared", "ipc", "cuda"},
    "engine": {"core", "executor", "shared", "structured", "ipc"},
    "frontend": {"engine", "shared", "structured", "ipc"},
    "facade": {"frontend", "shared"},
    "server": {"frontend", "engine", "shared", "structured", "facade", "ipc"},
}
ALLOWED["tools"] = set(ALLOWED) | {"facade"}  # the CLI and benchmarks use everything


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in TOP.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[1] != "pipeline":
        return parts[1]
    if len(parts) == 2:
        return "facade"
    return parts[2] if parts[2] in PIPELINE_FOLDERS else "shared"


def imports_of(path: Path, module: str) -> set[str]:
    """The ringllm modules `module` imports (a `from X import Y` of a submodule names Y)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ringllm.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("ringllm"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    return {m for m in found if m in MODULES and m != module}


def _edges() -> dict[str, set[str]]:
    return {m: imports_of(p, m) for m, p in MODULES.items()}


def test_every_import_goes_where_its_layer_may():
    wrong = []
    for module, deps in sorted(_edges().items()):
        mine = layer_of(module)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_ipc_imports_nothing_of_the_engine():
    for module, deps in _edges().items():
        if layer_of(module) == "ipc":
            assert all(layer_of(d) == "ipc" for d in deps), (module, deps)


def test_no_circle_between_folders():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, deps in _edges().items():
        for dep in deps:
            if layer_of(dep) != layer_of(module):
                graph[layer_of(module)].add(layer_of(dep))
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("folders import in a circle: " + " -> ".join(path + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "def f():\n    from ringllm.pipeline.core import scheduler\n"
        "from ringllm.pipeline.frontend.llm import LLM\n"
    )
    found = imports_of(source, "ringllm.pipeline.probe")
    assert found == {"ringllm.pipeline.core.scheduler", "ringllm.pipeline.frontend.llm"}


def _private_imports(path: Path, module: str) -> list[str]:
    """`from X import _name` where X lies outside `module`'s own folder."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level:
            continue
        base = node.module or ""
        if not base.startswith("ringllm"):
            continue
        source_package = base if base in MODULES and MODULES[base].name == "__init__.py" else None
        source_package = source_package or base.rpartition(".")[0]
        for alias in node.names:
            if alias.name.startswith("_") and source_package != package:
                found.append(f"{module} takes {base}.{alias.name}")
    return found


def test_no_private_name_crosses_a_folder():
    """A leading underscore means "this folder's own": another folder asks for a public name
    (a private helper that others need is made public where it lives)."""
    wrong = [hit for m, p in sorted(MODULES.items()) for hit in _private_imports(p, m)]
    assert not wrong, "private names imported from another folder:\n" + "\n".join(wrong)


def test_the_private_check_sees_a_crossing(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from ringllm.ipc import _atomics\nfrom ringllm.pipeline.models.linear import _x\n"
    )
    found = _private_imports(source, "ringllm.cuda.probe")
    assert found == [
        "ringllm.cuda.probe takes ringllm.ipc._atomics",
        "ringllm.cuda.probe takes ringllm.pipeline.models.linear._x",
    ]


def test_test_modules_have_unique_basenames():
    # tests/ has no __init__.py files, so pytest imports each test module by its basename:
    # two files of one name in different folders stop the whole collection.
    seen: dict[str, list[str]] = defaultdict(list)
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"test modules sharing a basename: {twice}"
