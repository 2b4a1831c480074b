"""The documentation tells the truth about the code and stays reachable.

- docs/architecture.md names only modules, classes, functions and methods that exist: every
  backticked `path.py`, `path.py: Name`, `path.py: Class.method / other` and `Class.method`,
  and in its drawings `Name (path.py` and `path.py Name`. A relative path (`worker/x.py`,
  `front_end.py`) resolves against the source folders.
- A backticked private name (`_name`) in a pipeline module's docstring is defined in that
  module (docstrings drift when code moves).
- README.md stays short; every page in docs/ is in mkdocs.yml's nav.

Each failure lists every stale reference, one per line.
"""

import ast
import re
from functools import cache
from pathlib import Path

import yaml  # PyYAML: with mkdocs (the docs extra) and transformers (the test extra)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE_DIRS = ("pipeline", "server", "ipc", "cuda", "tools", "tests")
README_MAX_LINES = 260

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PATH = r"[A-Za-z0-9_./]*[A-Za-z0-9_]\.py"
# `path.py`, `path.py: Name`, `path.py: Class.method / other / more`
BACKTICK_PATH = re.compile(rf"^({PATH})(?::\s*(.+))?$")
# `Class.method` or `Class.method / other` with no path
BACKTICK_MEMBER = re.compile(rf"^([A-Z]{IDENT})\.({IDENT})((?:\s*/\s*{IDENT})*)$")
# in the drawings: `Name (path.py` and `path.py Name` / `path.py: Name`
DRAWN_NAME_THEN_PATH = re.compile(rf"\b([A-Z]{IDENT}) \(({PATH})\b")
DRAWN_PATH_THEN_NAME = re.compile(rf"(?<![\w/.])({PATH}):? {{1,2}}({IDENT}(?:\.{IDENT})?)")


@cache
def all_modules() -> tuple[Path, ...]:
    found = []
    for folder in SOURCE_DIRS:
        found += sorted((ROOT / folder).rglob("*.py"))
    return tuple(p for p in found if ".venv" not in p.parts)


def resolve(path: str) -> list[Path]:
    """Every module a written path can mean: exact from the root, else any with that suffix."""
    exact = ROOT / path
    if exact.is_file():
        return [exact]
    suffix = "/" + path.lstrip("./")
    return [p for p in all_modules() if p.as_posix().endswith(suffix)]


@cache
def definitions(module: Path) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """(every name defined anywhere in the module, each class's members)."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    members: dict[str, frozenset[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
                    elif isinstance(leaf, ast.Attribute):
                        names.add(leaf.attr)  # self.x = ... : an attribute is a member too
        if isinstance(node, ast.ClassDef):
            inside = set()
            for leaf in ast.walk(node):
                if isinstance(leaf, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inside.add(leaf.name)
                elif isinstance(leaf, ast.Name) and isinstance(leaf.ctx, ast.Store):
                    inside.add(leaf.id)
                elif isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store):
                    inside.add(leaf.attr)
            members[node.name] = frozenset(inside)
    return frozenset(names), members


def defines(modules: list[Path], name: str, owner: str | None) -> bool:
    for module in modules:
        names, members = definitions(module)
        if owner is None and name in names:
            return True
        if owner is not None and name in members.get(owner, ()):
            return True
    return False


def check_names(path: str, modules: list[Path], spec: str) -> list[str]:
    """`Class.method / other / more` or `name / other` against the modules."""
    stale = []
    owner = None
    for i, part in enumerate(p.strip() for p in spec.split("/")):
        if not re.fullmatch(rf"{IDENT}(?:\.{IDENT})?", part):
            return stale  # prose after the colon, not a name list
        if "." in part:
            owner, name = part.split(".")
        elif i == 0:
            name = part
        else:
            name = part  # `A.b / c`: c is A's too, or else defined anywhere in the file
        if defines(modules, name, owner) or (owner and i > 0 and defines(modules, name, None)):
            continue
        where = f"{owner}.{name}" if owner and ("." in part or i > 0) else name
        stale.append(f"{path}: {where} is not defined there")
    return stale


def split_fences(text: str) -> tuple[list[str], list[str]]:
    prose, drawn, fence = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        (drawn if fence else prose).append(line)
    return prose, drawn


def stale_references(text: str) -> list[str]:
    prose, drawn = split_fences(text)
    stale: list[str] = []
    for span in re.findall(r"`([^`\n]+)`", "\n".join(prose)):
        span = span.strip()
        if m := BACKTICK_PATH.match(span):
            path, spec = m.group(1), m.group(2)
            modules = resolve(path)
            if not modules:
                stale.append(f"{path}: no such module")
            elif spec:
                stale += check_names(path, modules, spec)
        elif m := BACKTICK_MEMBER.match(span):
            owner, first, more = m.group(1), m.group(2), m.group(3)
            for name in [first] + [n.strip() for n in more.split("/") if n.strip()]:
                if not defines(list(all_modules()), name, owner):
                    stale.append(f"{owner}.{name}: no class {owner} defines it")
        elif re.fullmatch(r"(pipeline|server|ipc|cuda|tools|tests)/[\w/]*/", span):
            if not (ROOT / span).is_dir():
                stale.append(f"{span}: no such folder")
    drawing = "\n".join(drawn)
    for path in set(re.findall(rf"(?<![\w/.])({PATH})\b", drawing)):
        if not resolve(path):
            stale.append(f"{path}: no such module (in a drawing)")
    for name, path in DRAWN_NAME_THEN_PATH.findall(drawing):
        modules = resolve(path)
        plural = name.endswith("s") and defines(modules, name[:-1], None)  # "TensorRefs"
        if modules and not plural and not defines(modules, name, None):
            stale.append(f"{path}: {name} is not defined there (in a drawing)")
    for path, spec in DRAWN_PATH_THEN_NAME.findall(drawing):
        if not (spec[0].isupper() or "_" in spec):
            continue  # a plain word of the drawing, not a name
        if modules := resolve(path):
            stale += [s + " (in a drawing)" for s in check_names(path, modules, spec)]
    return sorted(set(stale))


def test_architecture_names_only_what_exists():
    stale = stale_references((DOCS / "architecture.md").read_text())
    assert not stale, "docs/architecture.md names what does not exist:\n" + "\n".join(stale)


@cache
def extension_modules() -> frozenset[str]:
    """The C extensions' module names (`cpu_kernels`): built from sources, not defined in Python."""
    sources = [p for p in (ROOT / "pipeline").rglob("*") if p.suffix in (".c", ".cpp", ".so")]
    text = " ".join(p.name for p in sources)
    text += " ".join(p.read_text(errors="ignore") for p in ROOT.glob("setup.*"))
    return frozenset(re.findall(rf"(_{IDENT})", text))


def test_pipeline_docstrings_name_only_their_own_private_names():
    stale = []
    for module in sorted((ROOT / "pipeline").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(module.read_text())) or ""
        names, _ = definitions(module)
        for name in re.findall(rf"`(_{IDENT})`", doc):
            if name.startswith("__") or name.endswith("_"):
                continue  # `__main__`, a prefix such as `_fp16_`: not a definition
            if name not in names and name not in extension_modules():
                stale.append(f"{module.relative_to(ROOT)}: docstring names {name}, not defined")
    assert not stale, "module docstrings name what does not exist:\n" + "\n".join(stale)


def test_the_checker_catches_known_drift(tmp_path):
    """The drift issue #28 found: a class placed in the wrong module, a missing method."""
    drawn = "```\n  ngram: NgramDrafter (worker/ngram_proposer.py, over)\n```\n"
    prose = "`core/scheduler.py: Scheduler._fit_drafts` and `Scheduler._fit_drafts`\n"
    stale = stale_references(drawn + prose)
    assert any("NgramDrafter" in s and "ngram_proposer.py" in s for s in stale), stale
    assert sum("_fit_drafts" in s for s in stale) == 2, stale
    assert stale_references("`worker/no_such_module.py`") == [
        "worker/no_such_module.py: no such module"
    ]
    assert stale_references("`pipeline/worker/worker.py: Worker`") == []


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in nav_pages(v)]
    if isinstance(node, list):
        return [p for v in node for p in nav_pages(v)]
    return []


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["theme"]["name"] == "material"
    in_nav = set(nav_pages(config["nav"]))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert "index.md" in pages
    missing = sorted(pages - in_nav)
    assert not missing, "pages missing from mkdocs.yml's nav:\n" + "\n".join(missing)
    dangling = sorted(in_nav - pages)
    assert not dangling, "nav entries with no page:\n" + "\n".join(dangling)


def test_readme_and_ci_run_the_same_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_line = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("python3 -m venv")
    ]
    assert len(ci_line) == 1
    assert ci_line[0] in readme.splitlines()
    assert "mkdocs build --strict" in ci_line[0]


def test_readme_links_point_at_files_that_exist():
    """Every relative link of README.md (a page of the site, the architecture map) resolves
    from the repository root, as GitHub and a local reader follow it."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    assert relative, "README.md links to no page of the docs"
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert not missing, "README.md links to files that do not exist: " + ", ".join(missing)
