"""Maintain the notebook collection: execute with provenance, keep the format canonical.

    python tools/nbtool.py run [NOTEBOOK ...]   execute on a GPU machine (default: all), stamp
                                                provenance, save outputs, refresh the README table
    python tools/nbtool.py check [--fix]        format check: header and badge, set-up cell,
                                                Colab metadata, exercise and hidden solution,
                                                teaching metadata, the README's generated
                                                sections (--fix rewrites what it can)
    python tools/nbtool.py new NN_topic "Title" "The question?"   start a notebook in the format
    python tools/nbtool.py margins [NOTEBOOK ...] [--runs N] [--cpus 0,1] [--add LOG ...]
    python tools/nbtool.py margins --set-aside RUN ... --why "ran beside another notebook"
                                                execute N times with claims recorded, not
                                                raised (or add logs pytest wrote), keep the runs
                                                in tests/margins.json, report each claim's margin
    python tools/nbtool.py sizes                each notebook's core path (before "## Going
                                                further") and whole size against the targets
    python tools/nbtool.py site                 build the static site from the committed outputs
                                                (nothing executed) into _site/
    python tools/nbtool.py reach [--unit NAME] [--since REV]   which notebooks the working
                                                tree's changes (or a change to a unit of
                                                helpers.py or checkup.py) make stale, and the
                                                device time to re-run them
    python tools/nbtool.py migrate-hashes [NOTEBOOK ...]   rehash stamps made over the code's
                                                text over its code (comments and docstrings cut),
                                                where that text is the one that ran
    python tools/nbtool.py lab [ARG ...]         JupyterLab (jupyter lab ARG ...) that saves a
                                                notebook it only opened as it was, whatever the
                                                reader's Python (tools/lab.py)

The tests import the functions below, so that what `run` stamps and what the tests verify is
computed by one piece of code.
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import copy
import datetime as dt
import difflib
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # helpers.py, when run as a script
NOTEBOOKS = ROOT / "notebooks"
README = ROOT / "README.md"
METADATA_KEY = "collection"  # same namespace as helpers.METADATA_KEY
NAME_PATTERN = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")
SETUP_TAG = "colab-setup"
CPU_OK_TAG = "cpu-ok"
SOLUTION_TAG = "solution"
SOLUTION_TITLE = "# @title Solution"  # Colab's form title: the code stays hidden until asked for
EXERCISE_HEADING = "## Exercise"
GOING_FURTHER = "## Going further"  # after it: depth, executed and checked, off the core path
CORE_WORDS, CORE_CODE_LINES, CELL_LINES = 1500, 250, 40  # the core path's targets
WORDS_A_MINUTE, CODE_LINES_A_MINUTE = 200, 20  # for the syllabus' reading times
TABLE_START, TABLE_END = "<!-- notebook-table:start -->", "<!-- notebook-table:end -->"
TEACHING_START, TEACHING_END = "<!-- teaching:start -->", "<!-- teaching:end -->"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"


def settings() -> dict:
    """The [tool.collection] table of pyproject.toml: where the repository is published."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["collection"]


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def write(nb: nbformat.NotebookNode, path: Path) -> None:
    nbformat.write(nb, path)


# ---------------------------------------------------------------------------- provenance

# What the hashes cover: the code as it runs, not the prose about it. Comments and docstrings are
# cut before hashing (runnable_text), so that mending one costs no GPU run: every stamp and every
# margin run stays current. Any other change is caught: code, a string literal (one that prints
# included), a default, an indentation. nbval's markers (``# NBVAL_CHECK_OUTPUT``) stay in: they
# decide what the nbval runs behind a notebook's margins compared. Stamps made before this hashed
# the text itself; `migrate-hashes` rewrites them (and their margin runs) where that text is the
# one that ran.
HASH_SCHEME = "code without comments and docstrings, v1"  # the stamp's "hash_scheme"
NBVAL_MARKER = "NBVAL_"


def is_setup_cell(cell) -> bool:
    return cell.cell_type == "code" and SETUP_TAG in cell.metadata.get("tags", [])


def _docstrings(tree) -> list[ast.Expr]:
    """The docstrings of every function and class in ``tree``: a string as the first statement
    of the body. (A cell's own first string is not one: a cell shows its last expression.)"""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.append(first)
    return found


def _column(line: str, utf8_offset: int) -> int:
    """ast's column (UTF-8 bytes) as a column in characters (tokenize's)."""
    return len(line.encode("utf-8")[:utf8_offset].decode("utf-8"))


def _one_newline(source: str) -> str:
    """``source`` with every line break as "\\n" (ast's and tokenize's rows then agree)."""
    return source.replace("\r\n", "\n").replace("\r", "\n")


def _parsed(source: str):
    """``source``'s syntax tree and tokens (of ``_one_newline(source)``), or None where it is
    not Python (an IPython magic)."""
    source = _one_newline(source)
    try:
        flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT  # as IPython runs a cell
        tree = compile(source, "<code>", "exec", flags=flags, dont_inherit=True)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (SyntaxError, ValueError, tokenize.TokenError):
        return None
    return tree, tokens


def runnable_text(source: str) -> str:
    """``source`` as the hashes see it: without its comments (nbval's markers kept) and
    docstrings, without blank lines and trailing spaces outside string literals. Source that
    does not parse as Python is hashed as written."""
    source = _one_newline(source)
    parsed = _parsed(source)
    if parsed is None:
        return source
    tree, tokens = parsed
    lines = source.split("\n")
    # a line whose end lies inside a string literal keeps its spaces, and its place if blank
    in_string = [False] * len(lines)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant | ast.JoinedStr) and node.end_lineno > node.lineno:
            for row in range(node.lineno, node.end_lineno):
                in_string[row - 1] = True
    cuts = [(d.lineno, _column(lines[d.lineno - 1], d.col_offset), d.end_lineno,
             _column(lines[d.end_lineno - 1], d.end_col_offset)) for d in _docstrings(tree)]
    cuts += [(*t.start, *t.end) for t in tokens if t.type == tokenize.COMMENT
             and not t.string.lstrip("#").strip().startswith(NBVAL_MARKER)]
    for first, start, last, end in sorted(cuts, reverse=True):  # cuts never overlap
        lines[first - 1:last] = [lines[first - 1][:start] + lines[last - 1][end:]]
        in_string[first - 1:last] = [in_string[last - 1]]
    kept = [line if keep else line.rstrip() for line, keep in zip(lines, in_string, strict=True)]
    return "\n".join(line for line, keep in zip(kept, in_string, strict=True) if line or keep)


def as_written(source: str) -> str:
    """``source`` itself: what stamps made before HASH_SCHEME hashed (migrate-hashes only)."""
    return source


def code_sha256(nb, hashed=runnable_text) -> str:
    """Hash of the code the outputs depend on: every code cell but the canonical set-up cell
    (which only locates helpers.py and is checked separately, so publishing needs no re-run)."""
    sources = [hashed(c.source) for c in nb.cells if c.cell_type == "code" and not is_setup_cell(c)]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def helpers_sha256() -> str:
    return hashlib.sha256((ROOT / "helpers.py").read_bytes()).hexdigest()


# What of helpers.py a notebook can reach. The notebooks' outputs depend on the parts of
# helpers.py that their code can reach, not on the whole file: each top-level statement of
# helpers.py is a unit, hashed by its own code (runnable_text: a line shift elsewhere, a comment
# or a docstring changes nothing); a notebook reaches the units its cells name, what those units
# name in turn, and every statement that runs on import whatever is used (an `if`, a call,
# `from __future__`). The stamp keeps one
# hash per reached unit, and one (ORDER_KEY) of the order in which the reached imports,
# assignments and other statements run, with any definitions of one name twice: moving such a
# statement past another can change what the module holds. A notebook is stale when one of them
# changed, appeared or vanished.


@dataclass
class Unit:
    """One top-level statement of helpers.py."""

    key: str  # the first name it defines (``name #2`` for a later one); always: <statement: sha>
    names: tuple[str, ...]  # the module-level names it binds (none for an always-unit)
    source: str  # its exact lines, from its first decorator to its last line
    always: bool  # runs on import and affects the module whatever is used: in every reach
    deps: frozenset[str]  # the keys of the other units it names
    ordered: bool  # its place among the others can matter (not a def or class of its own name)
    hashed: str  # what its hash covers: runnable_text(source), or the source (as_written)

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.hashed.encode()).hexdigest()[:16]


#: Module-level names that make every attribute access go through them.
_MODULE_HOOKS = {"__getattr__", "__dir__"}
#: Calls that read or write the module's namespace without naming what they touch.
_NAMESPACE_CALLS = {"globals", "eval", "exec"}
_NO_ARGUMENT_NAMESPACE_CALLS = {"vars", "dir", "locals"}
ORDER_KEY = "<order of statements>"
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")  # ast's line breaks, not \f


def _target_names(target) -> list[str] | None:
    """The names an assignment target binds; None when it writes into something else."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        names = [_target_names(t) for t in target.elts]
        return None if None in names else [n for group in names for n in group]
    return None  # obj.attr = ..., table[key] = ...: a side effect on import


def _bound_names(node) -> list[str] | None:
    """The module-level names a top-level statement binds; None for an always-unit."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return None if node.name in _MODULE_HOOKS else [node.name]
    if isinstance(node, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.module == "__future__" or any(a.name == "*" for a in node.names):
            return None  # compiler directives, or names nobody can list
        return [a.asname or a.name for a in node.names]
    if isinstance(node, ast.Assign):
        names = [_target_names(t) for t in node.targets]
        return None if None in names else [n for group in names for n in group]
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return _target_names(node.target)
    return None


def _uses(node) -> tuple[set[str], bool]:
    """The names a statement mentions, and whether it reaches the namespace wholesale."""
    names, everything = set(), False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
            everything |= sub.id == "globals"
        elif isinstance(sub, ast.Global | ast.Nonlocal):
            names.update(sub.names)
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
            everything |= sub.func.id in _NAMESPACE_CALLS or (
                sub.func.id in _NO_ARGUMENT_NAMESPACE_CALLS and not sub.args)
        elif (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute)
              and sub.value.attr == "modules"):
            everything |= any(isinstance(n, ast.Name) and n.id == "__name__"
                              for n in ast.walk(sub.slice))  # sys.modules[__name__]
    return names, everything


@functools.lru_cache(maxsize=8)  # parsed once per text: every notebook's checks read it
def helpers_units(text: str, hashed=runnable_text) -> dict[str, Unit]:
    """helpers.py's top-level statements as units, by key (in the order of the file), each
    hashed over ``hashed(its source)``."""
    tree = ast.parse(text)
    lines = _LINE.findall(text)
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the module's docstring
    found = []  # (key, names, source, uses, everything)
    for node in body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        source = "".join(lines[start - 1:node.end_lineno])
        names = _bound_names(node)
        base = (f"<statement: {hashlib.sha256(hashed(source).encode()).hexdigest()[:16]}>"
                if names is None else names[0])
        key, count = base, 1
        while any(key == other[0] for other in found):
            count += 1
            key = f"{base} #{count}"
        found.append((key, names, source, *_uses(node)))
    defined: dict[str, set[str]] = {}
    for key, names, *_ in found:
        for name in names or ():
            defined.setdefault(name, set()).add(key)
    every = {key for key, *_ in found}
    units = {}
    for (key, names, source, uses, everything), node in zip(found, body, strict=True):
        deps = every if everything else {k for n in uses for k in defined.get(n, ())}
        definition = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ordered = not definition or any(len(defined[n]) > 1 for n in names or ())
        units[key] = Unit(key, tuple(names or ()), source, names is None,
                          frozenset(deps - {key}), ordered, hashed(source))
    return units


def _from_import(module: str) -> re.Pattern:
    return re.compile(rf"\bfrom\s+{module}\s+import\s+(\([^)]*\)|(?:[^\n;#\\]|\\\n)*)")


def _alias(module: str) -> re.Pattern:
    return re.compile(rf"\bimport\s+{module}\s+as\s+(\w+)")


_FROM_HELPERS, _HELPERS_ALIAS = _from_import("helpers"), _alias("helpers")
#: Modules beside helpers.py that some notebooks import (checkup.py: 09 and 13). Each is hashed
#: as helpers.py is, unit by unit, into the stamp's "<module>_units" where a notebook imports it;
#: the units of helpers.py they reach count as the notebook's own.
SIBLINGS = ("checkup",)


def _hides_names(text: str, module: str) -> bool:
    """Whether code uses ``module`` (helpers or an alias of it) in a way that hides which of
    its names it uses: a star import, getattr, its namespace, or the module object handed on."""
    m = re.escape(module)
    patterns = [rf"\bgetattr\(\s*{m}\s*,", rf"\bvars\(\s*{m}\s*\)", rf"\bdir\(\s*{m}\s*\)",
                rf"\b{m}\s*\.\s*__dict__",
                # h = helpers, f(helpers), [helpers]: the module under another name
                rf"(?<!reload)(?:[=(\[,:]|\breturn|\byield)\s*{m}\s*(?:$|[,)\];#])"]
    return any(re.search(p, text, re.M) for p in patterns)


def notebook_helpers_roots(nb, hashed=runnable_text, module: str = "helpers") -> set[str] | None:
    """The names of helpers.py (``module``.py) that a notebook's code cells use, read from
    their text as hashed (string literals included, so a script the notebook writes to a file
    counts too; comments not); None when a cell hides which names it uses (``from helpers
    import *``, ``getattr(helpers, ...)``...): the whole module then."""
    texts = [hashed(c.source) for c in nb.cells if c.cell_type == "code"]
    return _module_roots("\n".join(texts), module)


def _module_roots(text: str, module: str) -> set[str] | None:
    """The names of ``module`` that code ``text`` uses (None: it hides which)."""
    m = re.escape(module)
    if re.search(rf"\bfrom\s+{m}\s+import\s+\(?\s*\*", text) \
            or re.search(rf"""(["']){m}\1""", text):  # sys.modules["helpers"], import_module
        return None
    modules = {module} | set(_alias(m).findall(text))
    if any(_hides_names(text, name) for name in modules):
        return None
    roots = set()
    for name in modules:
        roots.update(re.findall(rf"\b{re.escape(name)}\.(\w+)", text))
    for imported in _from_import(m).findall(text):
        imported = re.sub(r"#[^\n]*", "", imported).strip("()")
        for item in imported.replace("\\\n", " ").split(","):
            if item.split():
                roots.add(item.split()[0])  # "name" or "name as alias"
    return roots


def imports_module(nb, module: str) -> bool:
    """Whether a code cell imports ``module`` (``import checkup``, ``from checkup import``)."""
    pattern = rf"^\s*(?:import\s+{module}\b|from\s+{module}\s+import\b)"
    return any(re.search(pattern, c.source, re.M) for c in nb.cells if c.cell_type == "code")


def module_text(module: str) -> str:
    """``module``.py of the repository, as text ("" where there is none)."""
    path = ROOT / f"{module}.py"
    return path.read_bytes().decode("utf-8") if path.exists() else ""


def _reached(units: dict[str, Unit], roots: set[str] | None) -> set[str]:
    """The keys of ``units`` that ``roots`` reach (None: all), and the always-units."""
    if roots is None:
        return set(units)
    by_name = {}
    for unit in units.values():
        for name in unit.names:
            by_name.setdefault(name, set()).add(unit.key)
    todo = [k for root in roots for k in by_name.get(root, ())]
    todo += [unit.key for unit in units.values() if unit.always]
    reached = set()
    while todo:
        key = todo.pop()
        if key not in reached:
            reached.add(key)
            todo.extend(units[key].deps - reached)
    return reached


def _hashed_reach(units: dict[str, Unit], reached: set[str]) -> dict[str, str]:
    reach = {key: units[key].sha for key in sorted(reached)}
    order = [key for key in units if key in reached and units[key].ordered]  # file order
    reach[ORDER_KEY] = hashlib.sha256("\n".join(order).encode()).hexdigest()[:16]
    return reach


def sibling_reach(nb, module: str, text: str | None = None,
                  hashed=runnable_text) -> dict[str, str]:
    """The units of ``module``.py (``text``, default: the current file) that a notebook's code
    can reach, each with the hash of its code; empty where the notebook does not import it."""
    if not imports_module(nb, module):
        return {}
    units = helpers_units(module_text(module) if text is None else text, hashed)
    return _hashed_reach(units, _reached(units, notebook_helpers_roots(nb, hashed, module)))


def _sibling_helpers_roots(nb, siblings: dict[str, str] | None,
                           hashed=runnable_text) -> set[str] | None:
    """The names of helpers.py that the reached units of the modules beside it use (None: all
    of it); ``siblings``: module -> its text (default: the current files)."""
    roots: set[str] = set()
    for module in SIBLINGS:
        if not imports_module(nb, module):
            continue
        text = (siblings or {}).get(module)
        units = helpers_units(module_text(module) if text is None else text, hashed)
        reached = _reached(units, notebook_helpers_roots(nb, hashed, module))
        used = _module_roots("\n".join(units[key].hashed for key in sorted(reached)), "helpers")
        if used is None:
            return None
        roots |= used
    return roots


def helpers_reach(nb, text: str | None = None, hashed=runnable_text,
                  siblings: dict[str, str] | None = None) -> dict[str, str]:
    """The units of helpers.py (``text``, default: the current file) that a notebook's code can
    reach, each with the hash of its code: what its outputs may depend on. The notebook's code
    reaches them directly, or through a module beside helpers.py that it imports (checkup.py;
    ``siblings``: module -> its text, default: the current files)."""
    if text is None:
        text = (ROOT / "helpers.py").read_bytes().decode("utf-8")
    units = helpers_units(text, hashed)
    roots = notebook_helpers_roots(nb, hashed)
    through = _sibling_helpers_roots(nb, siblings, hashed)
    roots = None if roots is None or through is None else roots | through
    return _hashed_reach(units, _reached(units, roots))


def _reach_changes(stamped: dict, now: dict, shown: int = 12) -> str:
    """Which units differ between two reaches, for a problem line."""
    changes = sorted(k for k in stamped.keys() & now.keys() if stamped[k] != now[k])
    changes += [f"{k} is new" for k in sorted(now.keys() - stamped.keys())]
    changes += [f"{k} is gone" for k in sorted(stamped.keys() - now.keys())]
    more = len(changes) - shown
    return ", ".join(changes[:shown]) + (f" and {more} more" if more > 0 else "")


def sibling_stamps(nb, siblings: dict[str, str] | None = None,
                   hashed=runnable_text) -> dict[str, dict[str, str]]:
    """The stamp's "<module>_units" of each module beside helpers.py that the notebook imports
    (``siblings``: module -> its text, default: the current files)."""
    found = {}
    for module in SIBLINGS:
        reach = sibling_reach(nb, module, (siblings or {}).get(module), hashed)
        if reach:
            found[f"{module}_units"] = reach
    return found


def _stale_parts(nb, stamp: dict, helpers_text: str | None = None,
                 siblings: dict[str, str] | None = None) -> list[str]:
    """What changed since ``stamp`` was made: "code cells", the units of helpers.py, and those of
    each module beside it that the notebook imports (checkup.py)."""
    parts = []
    if stamp.get("code_sha256") != code_sha256(nb):
        parts.append("code cells")
    stamped, now = stamp.get("helpers_units", {}), helpers_reach(nb, helpers_text,
                                                                 siblings=siblings)
    if stamped != now:
        parts.append(f"helpers.py ({_reach_changes(stamped, now)})")
    now_siblings = sibling_stamps(nb, siblings)
    for module in SIBLINGS:
        key = f"{module}_units"
        stamped, now = stamp.get(key, {}), now_siblings.get(key, {})
        if stamped != now:
            parts.append(f"{module}.py ({_reach_changes(stamped, now)})")
    return parts


def provenance_problems(nb, name: str, helpers_text: str | None = None,
                        siblings: dict[str, str] | None = None) -> list[str]:
    """Why the committed outputs may not come from the committed code (empty list: they do);
    ``helpers_text`` is helpers.py, ``siblings`` the modules beside it, by name (default: the
    current files)."""
    stamp = nb.metadata.get(METADATA_KEY, {}).get("provenance")
    rerun = f"re-run it on a GPU: python tools/nbtool.py run notebooks/{name}"
    if not stamp:
        return [f"{name} has no provenance stamp: {rerun}"]
    if stamp.get("hash_scheme") != HASH_SCHEME:
        return [f"{name}: its stamp hashes the code as written, comments included: "
                f"python tools/nbtool.py migrate-hashes notebooks/{name}, or {rerun}"]
    problems = prose_problems(nb, name, helpers_text, siblings)
    for part in _stale_parts(nb, stamp, helpers_text, siblings):
        if part == "code cells":
            problems.append(f"{name}: its code cells changed since its outputs were made; {rerun}")
        else:
            problems.append(f"{name}: {part.replace(' (', ' changed where it reaches (', 1)} "
                            f"since its outputs were made; {rerun}")
    return problems


# Output that a hash-free edit could still change: a docstring printed (``__doc__``, ``help()``,
# ``inspect.getdoc``), our own source read (``inspect.getsource`` on helpers or the notebook's
# code), or a source location quoted (a traceback's or warning's line). None may appear.
_READS_DOCSTRINGS = {"__doc__", "getdoc", "pydoc", "help"}
_READS_SOURCE = {"getsource", "getsourcelines", "getcomments", "findsource"}
_QUOTES_SOURCE = re.compile(r'helpers\.py(?:", line |:)\d+|Cell In\[\d+\], line \d+'
                            r'|ipykernel_\d+/\d+\.py')


def prose_reads(source: str, own: set[str]) -> list[str]:
    """What in ``source`` reads a docstring, or the source of code named in ``own``: text the
    hashes leave out. Source that is not Python is searched as text (``helpers.x?`` too)."""
    parsed = _parsed(source)
    if parsed is None:
        found = re.findall(r"__doc__|\bhelp\(|getdoc|getsource|pydoc|\?\s*$", source, re.M)
        return [f.strip() or "?" for f in found]
    found = []
    for node in ast.walk(parsed[0]):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name in _READS_DOCSTRINGS:
            found.append(name)
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", None)
            named = {n.id for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Name)}
            if called in _READS_SOURCE and named & own:
                found.append(f"{called}({', '.join(sorted(named & own))})")
    return found


def _defined_names(source: str) -> set[str]:
    parsed = _parsed(source)
    return set() if parsed is None else {
        n.name for n in ast.walk(parsed[0])
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


def prose_problems(nb, name: str, helpers_text: str | None = None,
                   siblings: dict[str, str] | None = None) -> list[str]:
    """Where a notebook's outputs could change with what the hashes leave out (none: they
    cannot): its cells or the helpers it reaches reading docstrings or our source, or an output
    quoting a source line."""
    if helpers_text is None:
        helpers_text = (ROOT / "helpers.py").read_bytes().decode("utf-8")
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    own = {"helpers"} | set(_HELPERS_ALIAS.findall("\n".join(c.source for _, c in code)))
    own |= {n for _, c in code for n in _defined_names(c.source)}
    problems = [f"{name}, cell {i}: reads {', '.join(found)}, which the hashes leave out"
                for i, c in code if (found := prose_reads(c.source, own))]
    reached = [("helpers", helpers_units(helpers_text),
                helpers_reach(nb, helpers_text, siblings=siblings))]
    for module in SIBLINGS:
        text = (siblings or {}).get(module)
        reached.append((module, helpers_units(module_text(module) if text is None else text),
                        sibling_reach(nb, module, text)))
    for module, units, reach in reached:
        names = {n for unit in units.values() for n in unit.names}
        for key in reach:
            if key in units and (found := prose_reads(units[key].source, names)):
                problems.append(f"{name}: {module}.py's {key} reads {', '.join(found)}, which "
                                "the hashes leave out")
    for i, c in code:
        for output in c.get("outputs", []):
            text = json.dumps(output.get("traceback", [])) + json.dumps(output.get("text", "")) \
                + json.dumps(output.get("data", {}).get("text/plain", ""))
            if (quoted := _QUOTES_SOURCE.search(text)):
                problems.append(f"{name}, cell {i}: an output quotes a source line "
                                f"({quoted.group(0)}), which moves with comments")
    return problems


def migrate_hashes(path: Path, runs: list[dict]) -> str:
    """Rehash a stamp made before HASH_SCHEME, and the margin runs (``runs``, changed in place)
    of that version, over runnable_text; only where the text the stamp hashed is the text
    committed now, so that no stale notebook becomes current. Raises ValueError, touching
    nothing, otherwise. Returns what it did."""
    name = path.name
    nb = read(path)
    stamp = nb.metadata.get(METADATA_KEY, {}).get("provenance")
    rerun = f"re-run it on a GPU: python tools/nbtool.py run notebooks/{name}"
    if not stamp or "helpers_units" not in stamp:
        raise ValueError(f"{name}: refused: its stamp has no helpers_units to rehash; {rerun}")
    if stamp.get("hash_scheme") == HASH_SCHEME:
        return f"{name}: already hashed over its code ({HASH_SCHEME})"
    if stamp.get("code_sha256") != code_sha256(nb, as_written):
        raise ValueError(f"{name}: refused: its code cells are not the text its outputs were "
                         f"made with; {rerun}")
    then, now = stamp["helpers_units"], helpers_reach(nb, hashed=as_written)
    if then != now:
        raise ValueError(f"{name}: refused: helpers.py changed where it reaches "
                         f"({_reach_changes(then, now)}) since its outputs were made; {rerun}")
    old, new = run_version(nb, hashed=as_written), run_version(nb)
    moved = [run for run in runs if run["notebook"] == name and run.get("version") == old]
    for run in moved:
        run["version"] = new
    stamp.update(code_sha256=code_sha256(nb), helpers_units=helpers_reach(nb),
                 hash_scheme=HASH_SCHEME, **sibling_stamps(nb))
    write(nb, path)
    return f"{name}: stamp and {len(moved)} margin run(s) rehashed over its code"


# ---------------------------------------------------------------------------- an edit's price


def git_show(rev: str, relative: str, root: Path | None = None) -> str | None:
    """A file as committed at ``rev`` (None: not there)."""
    done = subprocess.run(["git", "show", f"{rev}:{relative}"], cwd=root or ROOT,
                          capture_output=True)
    return done.stdout.decode("utf-8") if done.returncode == 0 else None


def revalidation_runs(nb) -> int:
    """The GPU runs that make a stale notebook current again: its execution, then nbval until
    MARGIN_RUNS runs with all CPUs (the execution counts) and MARGIN_RUNS on 2 CPUs are
    current (tests/test_margins.py); a notebook for more GPUs rests on its execution."""
    one_gpu = nb.metadata.get(METADATA_KEY, {}).get("requires_gpus", 1) == 1
    return 2 * MARGIN_RUNS if one_gpu else 1


def price_table(stale: list[tuple[Path, object, str]]) -> str:
    """Each notebook's runs and device time (its stamped wall time each), and the total."""
    rows, total_runs, total_s = [], 0, 0.0
    for path, nb, why in stale:
        stamp = nb.metadata.get(METADATA_KEY, {}).get("provenance") or {}
        wall, runs = stamp.get("wall_seconds"), revalidation_runs(nb)
        seconds = (wall or 0.0) * runs
        total_runs, total_s = total_runs + runs, total_s + seconds
        gpus = nb.metadata.get(METADATA_KEY, {}).get("requires_gpus", 1)
        host = f" (a {gpus}-GPU machine)" if gpus > 1 else ""
        rows.append(f"  {path.name:<30} {wall or 0.0:6.1f} s x {runs:>2} = {seconds:5.0f} s  "
                    f"{why}{host}")
    rows.append(f"  {'total':<30} {total_runs:>13} runs = {total_s:5.0f} s  "
                f"({total_s / 60:.1f} min of device time)")
    rows.append(f"Runs: the execution, then nbval until {MARGIN_RUNS} runs with all CPUs and "
                f"{MARGIN_RUNS} under taskset -c 0,1 are current; each at its stamped wall time "
                "(the GPU it last ran on), a machine's start not counted.")
    return "\n".join(rows)


def edit_reach(rev: str = "HEAD") -> tuple[list, list]:
    """The notebooks that the working tree's changes since ``rev`` make stale (current at
    ``rev``, not now), with what changed; and those stale already at ``rev``."""
    helpers_then = git_show(rev, "helpers.py")
    siblings_then = {module: git_show(rev, f"{module}.py") or "" for module in SIBLINGS}
    made, already = [], []
    for path in notebook_paths():
        nb = read(path)
        stamp = nb.metadata.get(METADATA_KEY, {}).get("provenance") or {}
        if not provenance_problems(nb, path.name):
            continue
        committed = git_show(rev, f"notebooks/{path.name}")
        then = None if committed is None else nbformat.reads(committed, as_version=4)
        why = "; ".join(_stale_parts(nb, stamp)) or "no current stamp"
        if then is None or helpers_then is None \
                or provenance_problems(then, path.name, helpers_then, siblings_then):
            already.append((path, nb, why))
        else:
            made.append((path, nb, why))
    return made, already


def unit_reach(name: str) -> list[tuple[Path, object, str]]:
    """The notebooks that reach the unit ``name`` (or ``name #2``...) of helpers.py or of a
    module beside it (checkup.py): a change to its code makes them stale."""
    keys = {}
    for module in ("helpers", *SIBLINGS):
        units = helpers_units(module_text(module))
        keys[module] = {key for key in units if key == name or key.startswith(f"{name} #")}
    if not any(keys.values()):
        every = [key for module in ("helpers", *SIBLINGS)
                 for key in helpers_units(module_text(module))]
        near = difflib.get_close_matches(name, every, n=3)
        files = " and ".join(f"{module}.py" for module in ("helpers", *SIBLINGS))
        raise ValueError(f"{files} have no top-level {name!r}"
                         + (f" (did you mean {', '.join(near)}?)" if near else ""))
    found = []
    for path in notebook_paths():
        nb = read(path)
        reached = (keys["helpers"] & helpers_reach(nb).keys()) or any(
            keys[module] & sibling_reach(nb, module).keys() for module in SIBLINGS)
        if reached:
            found.append((path, nb, f"reaches {name}"))
    return found


def _reach(units: list[str], rev: str) -> int:
    """The `reach` command."""
    if units:
        try:
            reached = {name: unit_reach(name) for name in units}
        except ValueError as error:
            print(error, file=sys.stderr)
            return 1
        for name, found in reached.items():
            owners = [f"{module}.py's" for module in ("helpers", *SIBLINGS)
                      if name in helpers_units(module_text(module))]
            print(f"A change to the code of {' or '.join(owners) or 'the'} {name} makes "
                  f"{len(found)} notebook(s) "
                  "stale (a comment or docstring: none):")
            print(price_table(found))
        return 0
    made, already = edit_reach(rev)
    if made:
        print(f"The changes since {rev} make {len(made)} notebook(s) stale:")
        print(price_table(made))
    else:
        print(f"The changes since {rev} make no notebook stale.")
    if already:
        print(f"Stale at {rev} already: {', '.join(p.name for p, *_ in already)}")
    return 0


def kernel_peak_rss_mib(client) -> float | None:
    """Peak resident memory of the notebook's kernel process (Linux /proc), if readable."""
    process = getattr(getattr(client.km, "provisioner", None), "process", None)
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except (AttributeError, OSError):
        return None
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(match.group(1)) / 1024 if match else None


def gpu_names(count: int = 1) -> str | None:
    """The GPU a notebook ran on, or the ``count`` GPUs it needs ("2 x NVIDIA H200")."""
    import torch

    if not torch.cuda.is_available():
        return None
    names = [torch.cuda.get_device_name(i) for i in range(min(count, torch.cuda.device_count()))]
    if len(names) > 1 and len(set(names)) == 1:
        return f"{len(names)} x {names[0]}"
    return ", ".join(names)


@contextlib.contextmanager
def kernel_environment(env: dict[str, str]):
    """``env`` in this process's environment while the block runs, which the kernels started
    in it inherit; the environment as it was afterwards."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: What a committed run's kernel is told: no reader types guesses, and a claim that fails
#: stops the run (helpers.GUESSES, helpers.STRICT_CLAIMS)
COMMITTED_RUN_ENV = {"COLLECTION_GUESSES": "skip", "COLLECTION_STRICT_CLAIMS": "1"}


def execute(path: Path, timeout: int = 600) -> dict:
    """Run a notebook top to bottom in a fresh kernel in its folder; stamp and save it."""
    import torch
    from nbclient import NotebookClient

    nb = read(path)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    peak = {"rss": None}
    watch = {}

    def on_notebook_start(**_):
        # the kernel and every process it starts (DataLoader workers), sampled from outside it
        process = getattr(getattr(client.km, "provisioner", None), "process", None)
        if process is not None:
            from helpers import MemoryWatch

            watch["tree"] = MemoryWatch(interval_s=0.1, pid=process.pid)

    def on_cell_executed(**_):
        peak["rss"] = kernel_peak_rss_mib(client) or peak["rss"]

    client.on_notebook_start = on_notebook_start
    client.on_cell_executed = on_cell_executed
    start = time.perf_counter()
    with kernel_environment(COMMITTED_RUN_ENV):
        client.execute()
    wall = time.perf_counter() - start
    tree_peak = watch["tree"].stop() if "tree" in watch else None
    nb.metadata.setdefault(METADATA_KEY, {})["provenance"] = {
        "gpu": gpu_names(nb.metadata.get(METADATA_KEY, {}).get("requires_gpus", 1)),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "date": dt.datetime.now(dt.UTC).date().isoformat(),
        "usable_cpus": len(os.sched_getaffinity(0)), "host_cpus": os.cpu_count(),
        "wall_seconds": round(wall, 1),
        "kernel_peak_rss_mib": None if peak["rss"] is None else round(peak["rss"]),
        "process_tree_peak_mib": None if tree_peak is None else round(tree_peak),
        "hash_scheme": HASH_SCHEME, "code_sha256": code_sha256(nb),
        "helpers_sha256": helpers_sha256(), "helpers_units": helpers_reach(nb),
        **sibling_stamps(nb),
    }
    fix(nb, path, settings())
    write(nb, path)
    return nb.metadata[METADATA_KEY]["provenance"]


# ---------------------------------------------------------------------------- format


def colab_url(name: str, conf: dict, branch: str | None = None) -> str:
    """A notebook on Colab: the committed run (``branch`` main), or the copy without outputs
    (``conf["run_branch"]``)."""
    return (f"https://colab.research.google.com/github/{conf['repository']}/blob/"
            f"{branch or conf['branch']}/notebooks/{name}")


def run_url(name: str, conf: dict) -> str:
    """The notebook without outputs on Colab, to predict, then run."""
    return colab_url(name, conf, conf["run_branch"])


def badge(name: str, conf: dict) -> str:
    """Colab's badge to the copy without outputs, and a link to the committed run."""
    return (f"[![Open In Colab]({COLAB_BADGE})]({run_url(name, conf)}) to run it yourself "
            f"(no outputs: predict first), or [read the committed run]({colab_url(name, conf)})")


def blank_notebook(nb):
    """The notebook as a reader who predicts before running gets it: the same cells, no
    outputs, no execution counts or timings, and the answers in words behind a click (Colab
    shows a markdown cell whatever its metadata says)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    fold_answers_in_words(nb)
    return nb


def fold_answers_in_words(nb) -> None:
    """Each short answer, and each answer in words after a solution, inside ``<details>``: plain
    HTML that Colab, GitHub, JupyterLab and the site all show folded."""
    answers = set(answer_cells(nb))
    for i, cell in enumerate(nb.cells):
        if i in answers or is_short_answer(cell):
            summary = ANSWER_SUMMARY if i in answers else SHORT_SUMMARY
            cell.source = (f'<details class="answer">\n<summary>{summary}</summary>'
                           f"\n\n{cell.source}\n\n</details>")


def write_blank_copies(out: Path) -> list[Path]:
    """Each notebook without outputs in ``out``/notebooks (what the run branch holds), and
    helpers.py and the modules beside it (checkup.py) in ``out``, where their set-up cells find
    them outside Colab."""
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    for name in ("helpers", *SIBLINGS):
        shutil.copyfile(ROOT / f"{name}.py", out / f"{name}.py")
    written = []
    for path in notebook_paths():
        write(blank_notebook(read(path)), out / "notebooks" / path.name)
        written.append(out / "notebooks" / path.name)
    return written


def github_url(relative: str, conf: dict) -> str:
    """A file of the repository (path relative to its root) as GitHub shows it."""
    return f"https://github.com/{conf['repository']}/blob/{conf['branch']}/{relative}"


def header_source(name: str, nb, conf: dict) -> str:
    info = nb.metadata.get(METADATA_KEY, {})
    number = name[:2]
    return (f"# {number} · {info.get('title', '')}\n\n{badge(name, conf)}\n\n"
            f"**The question:** {info.get('question', '')}")


SETUP_TIMEOUT_S = 30  # the set-up cell's download: this long without an answer is a failure


def setup_modules(nb) -> tuple[str, ...]:
    """The files beside helpers.py that a notebook's set-up cell fetches too: checkup.py for a
    notebook that imports checkup (09 and 13); none for the others."""
    return tuple(f"{module}.py" for module in SIBLINGS if imports_module(nb, module))


def setup_source(conf: dict, modules: tuple[str, ...] = ()) -> str:
    """The set-up cell: helpers.py found (on Colab: downloaded), and ``modules`` beside it (the
    files of ``setup_modules``) found and downloaded the same way."""
    if modules:
        return _setup_source_with(conf, modules)
    return f'''\
# Set-up: find helpers.py (on Colab: download it, and install what Colab lacks, never torch).
import os
import sys


class SetUpFailed(Exception):
    def _render_traceback_(self):  # Jupyter shows this one line, not a traceback
        return [f"Set-up failed: {{self}}"]


if "google.colab" in sys.modules and not os.path.exists("helpers.py"):
    import urllib.request

    repository = "{conf['repository']}"  # where the collection is published
    helpers_url = f"https://raw.githubusercontent.com/{{repository}}/{conf['branch']}/helpers.py"
    try:  # {SETUP_TIMEOUT_S} s without an answer (to connect, or between bytes) fails, not hangs
        with urllib.request.urlopen(helpers_url, timeout={SETUP_TIMEOUT_S}) as answer:
            downloaded = answer.read()
    except OSError as error:  # HTTP 404 where the collection is not published at that address
        raise SetUpFailed(f"cannot download helpers.py from {{helpers_url}} ({{error}}): is the "
                          "collection published there? ([tool.collection] in pyproject.toml)"
                          ) from None
    with open("helpers.py", "wb") as file:
        file.write(downloaded)
if not any(os.path.exists(os.path.join(folder, "helpers.py")) for folder in (".", "..")):
    raise SetUpFailed("no helpers.py in this folder or the one above: open the notebook in a "
                      "clone of the collection, or in a copy that `nbtool.py blank` wrote")
sys.path.insert(0, ".." if os.path.exists("../helpers.py") else ".")
import helpers  # noqa: E402

helpers.colab_setup()'''


def _setup_source_with(conf: dict, modules: tuple[str, ...]) -> str:
    """``setup_source`` for a notebook that imports ``modules`` too: one loop fetches each."""
    files = ", ".join(f'"{name}"' for name in ("helpers.py", *modules))
    return f'''\
# Set-up: find helpers.py (on Colab: download it, and install what Colab lacks, never torch),
# and {" and ".join(modules)} beside it, which this notebook imports too.
import os
import sys


class SetUpFailed(Exception):
    def _render_traceback_(self):  # Jupyter shows this one line, not a traceback
        return [f"Set-up failed: {{self}}"]


for module in ({files}):
    if "google.colab" in sys.modules and not os.path.exists(module):
        import urllib.request

        repository = "{conf['repository']}"  # where the collection is published
        url = f"https://raw.githubusercontent.com/{{repository}}/{conf['branch']}/{{module}}"
        try:  # {SETUP_TIMEOUT_S} s with no answer (to connect, or between bytes) fails, not hangs
            with urllib.request.urlopen(url, timeout={SETUP_TIMEOUT_S}) as answer:
                downloaded = answer.read()
        except OSError as error:  # HTTP 404 where the collection is not published at that address
            raise SetUpFailed(f"cannot download {{module}} from {{url}} ({{error}}): is the "
                              "collection published there? ([tool.collection] in pyproject.toml)"
                              ) from None
        with open(module, "wb") as file:
            file.write(downloaded)
    if not any(os.path.exists(os.path.join(folder, module)) for folder in (".", "..")):
        raise SetUpFailed(f"no {{module}} in this folder or the one above: open the notebook in "
                          "a clone of the collection, or in a copy that `nbtool.py blank` wrote")
sys.path.insert(0, ".." if os.path.exists("../helpers.py") else ".")
import helpers  # noqa: E402

helpers.colab_setup()'''


CANONICAL_METADATA = {
    "accelerator": "GPU",
    "colab": {"gpuType": "T4", "provenance": []},
}
# The kernel must be python3, the one nbval and Colab start. JupyterLab, on opening a notebook,
# writes the kernel's spec and language_info into its metadata; where either differs from what
# the notebook holds, it marks the notebook modified and autosaves it, numbers as JavaScript
# writes them (20.0 as 20), and the reader's `git pull` refuses (tests/test_jupyterlab.py). So
# the kernelspec is exactly what JupyterLab writes for ipykernel's own, display name included.
# language_info is the kernel's that executed the notebook (nbclient writes it): a reader's
# kernel matches it on that Python version only, and on another JupyterLab rewrites the notebook
# whatever it holds. A notebook JupyterLab saved still passes the checks (the kernelspec's
# display name aside, where the reader's kernelspec has another: `check --fix` restores it).
KERNEL = {"name": "python3", "language": "python"}
NEW_KERNELSPEC = {"display_name": "Python 3 (ipykernel)", **KERNEL}  # ipykernel's, as it writes


def is_solution_cell(cell) -> bool:
    return cell.cell_type == "code" and SOLUTION_TAG in cell.metadata.get("tags", [])


def answer_cells(nb) -> list[int]:
    """The markdown cells right after a solution that do not open with a heading: the
    exercise's answer in words, folded with the solution so that a reader meets it only after
    trying."""
    cells = nb.cells
    return [i + 1 for i, cell in enumerate(cells[:-1])
            if is_solution_cell(cell) and cells[i + 1].cell_type == "markdown"
            and not cells[i + 1].source.lstrip().startswith("#")]


def solution_problems(name: str, nb) -> list[str]:
    """A workshop notebook ends with an exercise and a worked solution: a code cell tagged
    ``solution``, hidden until asked for (JupyterLab: source_hidden; Colab: a form titled
    "Solution"), whose result is checked by a claim, after an "## Exercise" heading."""
    cells = nb.cells
    solutions = [i for i, c in enumerate(cells) if is_solution_cell(c)]
    if not solutions:
        return [f"{name}: needs a code cell tagged '{SOLUTION_TAG}' (the exercise's solution)"]
    problems = []
    exercise = [i for i, c in enumerate(cells) if c.cell_type == "markdown"
                and any(line.startswith(EXERCISE_HEADING) for line in c.source.splitlines())]
    if not exercise or exercise[0] > solutions[0]:
        problems.append(f"{name}: a markdown cell with '{EXERCISE_HEADING}' must come before "
                        "the first solution")
    further = going_further_at(nb)
    if further is not None and solutions[0] > further:
        problems.append(f"{name}: the exercise and its solution belong to the core path, before "
                        f"'{GOING_FURTHER}'")
    for i in solutions:
        cell = cells[i]
        if not cell.source.startswith(SOLUTION_TITLE + "\n"):
            problems.append(f"{name}, cell {i}: a solution starts with '{SOLUTION_TITLE}'")
        if cell.metadata.get("jupyter", {}).get("source_hidden") is not True \
                or cell.metadata.get("cellView") != "form":
            problems.append(f"{name}, cell {i}: a solution is hidden (jupyter.source_hidden, "
                            "cellView: form)")
        if "helpers.claim(" not in cell.source:
            problems.append(f"{name}, cell {i}: a solution checks its result with helpers.claim")
        if cell.metadata.get("jupyter", {}).get("outputs_hidden") is not True:
            problems.append(f"{name}, cell {i}: a solution's outputs are hidden too "
                            "(jupyter.outputs_hidden): they hold the answer")
    for i in answer_cells(nb):
        if cells[i].metadata.get("jupyter", {}).get("source_hidden") is not True:
            problems.append(f"{name}, cell {i}: the answer after a solution is hidden "
                            "(jupyter.source_hidden)")
        if any(line.startswith("#") for line in cells[i].source.splitlines()):
            problems.append(f"{name}, cell {i}: the answer after a solution holds no heading: "
                            "what follows it starts a cell of its own")
    return problems


_SAVED_FIGURE = re.compile(r"""save_figure\(\s*\w+\s*,\s*["']([^"']+)["']""")
FIGURE_TEXTS = "figures"  # cell metadata: collection.figures = {name: {"alt": ..., "caption": ...}}
FIGURE_TEXT_LIMITS = {"alt": 250, "caption": 400}  # characters


def image_outputs(cell) -> list[int]:
    """The indices of a code cell's outputs that are figures (PNG images)."""
    return [i for i, output in enumerate(cell.get("outputs", []))
            if "image/png" in output.get("data", {})]


def saved_figures(cell) -> list[str]:
    """The names a cell saves its figures under (``helpers.save_figure(fig, "NAME")``), in the
    order it draws them: the order of its image outputs."""
    return _SAVED_FIGURE.findall(cell.source) if cell.cell_type == "code" else []


def figure_texts(cell) -> list[dict]:
    """Each figure of a cell, in output order: its name, alt text and caption (the site shows
    them; a screen reader reads the alt text)."""
    texts = cell.metadata.get(METADATA_KEY, {}).get(FIGURE_TEXTS, {})
    return [{"name": name, **texts.get(name, {})} for name in saved_figures(cell)]


def figure_problems(name: str, nb) -> list[str]:
    """Every figure is saved under a name and has alt text and a caption: what it shows, in
    words, not a file name."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        images, saved = image_outputs(cell), saved_figures(cell)
        if len(images) != len(saved):
            problems.append(f"{name}, cell {i}: {len(images)} figure(s) shown, {len(saved)} "
                            "saved with helpers.save_figure: one name per figure")
        known = cell.metadata.get(METADATA_KEY, {}).get(FIGURE_TEXTS, {})
        for stray in sorted(set(known) - set(saved)):
            problems.append(f"{name}, cell {i}: figure text for '{stray}', which the cell "
                            "does not save")
        for figure in figure_texts(cell):
            for key, limit in FIGURE_TEXT_LIMITS.items():
                text = figure.get(key, "")
                if not isinstance(text, str) or len(text.split()) < 4:
                    problems.append(f"{name}, cell {i}: figure '{figure['name']}' needs "
                                    f"its {key} in a sentence (cell metadata {METADATA_KEY}."
                                    f"{FIGURE_TEXTS})")
                elif len(text) > limit or re.search(r"\.png\b|_images/", text):
                    problems.append(f"{name}, cell {i}: figure '{figure['name']}': its {key} "
                                    f"says what it shows in {limit} characters at most, "
                                    "not a file name")
    return problems


# "owner/repo#123" in prose, not already the text of a link: GitHub links it, a notebook doesn't
_BARE_ISSUE = re.compile(r"(?<![\[\w/.-])([\w.-]+/[\w.-]+) ?#(\d+)(?!\]|\w)")  # "a/b #1" too


def linked_issues(markdown: str) -> str:
    """``markdown`` with each bare issue reference (pytorch/pytorch#85796) made a link to it."""
    return _BARE_ISSUE.sub(r"[\1#\2](https://github.com/\1/issues/\2)", markdown)


def issue_link_problems(name: str, nb) -> list[str]:
    return [f"{name}, cell {i}: issue reference {m.group(0)} is not a link "
            "(check --fix links it)"
            for i, cell in enumerate(nb.cells) if cell.cell_type == "markdown"
            for m in _BARE_ISSUE.finditer(cell.source)]


# Teaching (issue 34): a reader predicts (typed, where the notebook asks for a number), meets a
# short answer folded under the question, reads one line per result, and sees the record and
# the checks only on a click (they still run, and nbval compares them).
PREDICTION = re.compile(r"^\*\*Predict", re.M)  # a prompt: "**Predict before you run.**"
SHORT_ANSWER = "**Short answer.**"  # a markdown cell, folded, right after the prediction
ANSWER_LABEL = "**The answer.**"  # the answer in words after an exercise's solution, folded
# A folded cell's first line is all JupyterLab shows of it: the label alone, never the answer.
FOLD_LABELS = (SHORT_ANSWER, ANSWER_LABEL)
GUESS = re.compile(r"^(my_guess\w*) = ", re.M)  # the reader's typed prediction
ANSWERED = re.compile(r"helpers\.answer\([^)]*?\b(my_guess\w*)\b", re.S)
# Notebooks whose predictions are typed and echoed by helpers.answer; the set only grows, to
# every notebook.
TYPED_PREDICTIONS: frozenset = frozenset({
    "00_timing_async_work.ipynb", "01_pageable_and_pinned.ipynb", "02_bus_bandwidth.ipynb",
    "03_non_blocking.ipynb", "04_overlap.ipynb", "05_device_to_host.ipynb",
    "06_dataloader_pinning.ipynb", "07_prefetching.ipynb", "08_tensordict_threads.ipynb",
    "09_training_step.ipynb", "10_two_gpus.ipynb", "11_activation_offload.ipynb",
    "12_checkpoint_loading.ipynb", "13_host_bound_steps.ipynb"})
BOOKKEEPING = frozenset({"record", "claim", "claim_where"})
SHORT_SUMMARY = "Show the short answer"
CHECKS_PROMPT = "Show the record and the checks"


def _is_bookkeeping_call(statement) -> bool:
    call = statement.value if isinstance(statement, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in BOOKKEEPING and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "helpers")


def bookkeeping_statements(cell) -> list[bool]:
    """For each top-level statement of a code cell: is it bookkeeping (a helpers.record or
    claim call, or a loop or an ``if`` of nothing else)?"""
    try:
        tree = ast.parse(cell.source)
    except SyntaxError:
        return []
    return [_is_bookkeeping_call(st) or (isinstance(st, (ast.For, ast.If)) and all(
        _is_bookkeeping_call(inner) for inner in [*st.body, *st.orelse]))
        for st in tree.body]


def is_bookkeeping_cell(cell) -> bool:
    """A code cell that only records and checks results: folded, as a solution is."""
    if cell.cell_type != "code" or is_solution_cell(cell) or is_setup_cell(cell):
        return False
    kinds = bookkeeping_statements(cell)
    return bool(kinds) and all(kinds)


def is_folded(cell) -> bool:
    jupyter = cell.metadata.get("jupyter", {})
    return jupyter.get("source_hidden") is True and (cell.cell_type == "markdown" or (
        jupyter.get("outputs_hidden") is True and cell.metadata.get("cellView") == "form"))


def is_short_answer(cell) -> bool:
    return cell.cell_type == "markdown" and cell.source.startswith(SHORT_ANSWER)


def labelled(source: str, label: str) -> str:
    """``source`` with ``label`` as a line of its own on top (JupyterLab shows a folded cell's
    first line)."""
    rest = source.removeprefix(label) if source.startswith(label) else source
    return f"{label}\n\n{rest.lstrip()}"


def fold_label_problems(name: str, nb) -> list[str]:
    """A folded markdown cell's first line, which JupyterLab shows in place of the cell, is
    only its label: it gives nothing away."""
    return [f"{name}, cell {i}: a folded cell's first line shows: it should be only one of "
            f"{', '.join(FOLD_LABELS)} (check --fix moves the rest below it)"
            for i, cell in enumerate(nb.cells)
            if cell.cell_type == "markdown" and is_folded(cell)
            and cell.source.split("\n", 1)[0].strip() not in FOLD_LABELS]


def prediction_problems(name: str, nb, typed: frozenset = TYPED_PREDICTIONS) -> list[str]:
    """Each prediction prompt is followed by the reader's typed guess (in the notebooks of
    ``typed``: a ``my_guess = ...`` cell, echoed later by helpers.answer) and a folded short
    answer."""
    cells, problems = nb.cells, []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown" or not PREDICTION.search(cell.source):
            continue
        after = i + 1
        if after < len(cells) and cells[after].cell_type == "code" \
                and GUESS.search(cells[after].source):
            after += 1
        elif name in typed:
            problems.append(f"{name}, cell {i}: a prediction is typed: a code cell "
                            "'my_guess = ...' right after the prompt")
        if after >= len(cells) or not is_short_answer(cells[after]):
            problems.append(f"{name}, cell {i}: a short answer ('{SHORT_ANSWER} ...') comes "
                            "right after the prediction (and its my_guess cell)")
        elif not is_folded(cells[after]):
            problems.append(f"{name}, cell {after}: the short answer is folded "
                            "(jupyter.source_hidden): the reader predicts first")
    if name in typed:
        code = "\n".join(c.source for c in cells if c.cell_type == "code")
        for guess in sorted(set(GUESS.findall(code)) - set(ANSWERED.findall(code))):
            problems.append(f"{name}: {guess} is never shown beside its result "
                            f"(helpers.answer(key, {guess}))")
    for i, cell in enumerate(cells):
        for guess in GUESS.findall(cell.source) if cell.cell_type == "code" else ():
            if f'helpers.expect_guess({guess}, "{guess}")' not in cell.source:
                problems.append(f"{name}, cell {i}: Run all stops at an empty guess: end the "
                                f'cell with helpers.expect_guess({guess}, "{guess}")')
    return problems


def bookkeeping_problems(name: str, nb, typed: frozenset = TYPED_PREDICTIONS) -> list[str]:
    """On the core path, the record and the checks are folded (check --fix folds them); in a
    notebook of ``typed``, no cell mixes them with the code a reader reads."""
    problems = []
    for i, cell in _core_cells(nb):
        if is_bookkeeping_cell(cell):
            if not is_folded(cell):
                problems.append(f"{name}, cell {i}: the record and the checks are folded "
                                "(source and outputs hidden, cellView form; check --fix folds "
                                "them)")
        elif name in typed and cell.cell_type == "code" and not is_solution_cell(cell) \
                and any(bookkeeping_statements(cell)):
            problems.append(f"{name}, cell {i}: split the record and the checks from the code "
                            "a reader reads, into a cell of their own")
    return problems


def teaching_problems(name: str, nb) -> list[str]:
    """The syllabus and the rules of thumb in the README come from this metadata."""
    info = nb.metadata.get(METADATA_KEY, {})
    problems = []
    if not isinstance(info.get("builds_on"), list) or not info.get("concepts"):
        problems.append(f"{name}: metadata.{METADATA_KEY} needs builds_on (notebook numbers) "
                        "and concepts (for the README's syllabus)")
    rules = info.get("rules")
    if not rules:
        problems.append(f"{name}: metadata.{METADATA_KEY}.rules needs at least one rule of "
                        "thumb with the key of the measurement that supports it")
        return problems
    recorded = {m["key"] for m in outputs_metadata(nb, "measurement")}
    for rule in rules:
        if recorded and rule.get("evidence") not in recorded:
            problems.append(f"{name}: the rule '{rule.get('rule')}' cites "
                            f"{rule.get('evidence')!r}, which the notebook does not record")
    return problems


def _counted_cells(nb) -> list[tuple[int, object]]:
    """The cells a reader reads: all but the set-up cell, the hidden solutions and answers, and
    the folded record and checks."""
    answers = set(answer_cells(nb))
    return [(i, c) for i, c in enumerate(nb.cells)
            if not is_setup_cell(c) and not is_solution_cell(c) and i not in answers
            and not (is_bookkeeping_cell(c) and is_folded(c))]


def going_further_at(nb) -> int | None:
    """The index of the markdown cell with the "## Going further" heading (None: no split)."""
    return next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
                 and any(line.startswith(GOING_FURTHER) for line in c.source.splitlines())),
                None)


def _core_cells(nb) -> list[tuple[int, object]]:
    """The cells before the "## Going further" heading (all of them, where there is none)."""
    split = going_further_at(nb)
    return list(enumerate(nb.cells))[:split]


_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")  # a markdown link's or image's address


def _words(text: str) -> int:
    """Words a reader reads: a link's text counts, its address does not."""
    return len(re.findall(r"[^\W_][\w'’.-]*", _LINK_TARGET.sub("]", text)))


def _code_lines(source: str) -> int:
    return sum(1 for line in source.splitlines()
               if line.strip() and not line.strip().startswith("#"))


def _cell_lines(source: str) -> int:
    """Non-blank lines, but not those of a script the cell writes to a file (a %%writefile
    cell, or a multi-line string such as a script's text)."""
    if source.startswith("%%writefile"):
        return 0
    lines = source.splitlines()
    inside: set[int] = set()
    try:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.end_lineno > node.lineno:
                inside.update(range(node.lineno, node.end_lineno + 1))
    except SyntaxError:  # IPython magics: count every line
        pass
    return sum(1 for number, line in enumerate(lines, 1)
               if line.strip() and number not in inside)


def core_sizes(nb) -> dict:
    """Prose words and code lines (neither blank nor comment) of the core path, the cells
    before the "## Going further" heading, and of the whole notebook (the set-up cell and the
    hidden solutions left out of both); the longest code cell, in non-blank lines (a script
    written to a file with %%writefile is exempt); and whether the notebook has the split."""
    cells = _counted_cells(nb)
    split = going_further_at(nb)

    def size(chosen):
        return (sum(_words(c.source) for _, c in chosen if c.cell_type == "markdown"),
                sum(_code_lines(c.source) for _, c in chosen if c.cell_type == "code"))

    core = [(i, c) for i, c in cells if split is None or i < split]
    longest = max(((_cell_lines(c.source), i) for i, c in cells if c.cell_type == "code"),
                  default=(0, None))
    return {"core": size(core), "whole": size(cells), "longest": longest,
            "split": split is not None}


# Notebooks still too long for a core path that have not been split yet (issue 21). The list
# only shrinks: a notebook on it that meets the targets, or has been split, is a problem too.
NOT_YET_SPLIT: frozenset = frozenset()


def core_problems(name: str, nb, not_yet_split: frozenset = NOT_YET_SPLIT) -> list[str]:
    """The core path (the notebook before "## Going further", or all of it where it has none)
    keeps within the targets, and every code cell is short. A notebook over the targets must be
    split, unless ``not_yet_split`` names it."""
    sizes = core_sizes(nb)
    (words, lines), (longest, index) = sizes["core"], sizes["longest"]
    problems = []
    if words > CORE_WORDS:
        problems.append(f"{name}: the core path has {words} prose words (target {CORE_WORDS})")
    if lines > CORE_CODE_LINES:
        problems.append(f"{name}: the core path has {lines} code lines "
                        f"(target {CORE_CODE_LINES})")
    if longest > CELL_LINES:
        problems.append(f"{name}, cell {index}: {longest} lines in one code cell "
                        f"(target {CELL_LINES})")
    if name in not_yet_split:
        if sizes["split"] or not problems:
            return [f"{name}: meets the core-path targets or is split: take it off "
                    "NOT_YET_SPLIT in tools/nbtool.py"]
        return []
    if problems and not sizes["split"]:
        problems.append(f"{name}: split it into a core path and a \"{GOING_FURTHER[3:]}\" "
                        "section")
    return problems


def reading_minutes(words: int, code_lines: int) -> float:
    return words / WORDS_A_MINUTE + code_lines / CODE_LINES_A_MINUTE


def sizes_report(paths: list[Path]) -> str:
    rows = [f"{'notebook':<32}{'core words':>11}{'core code':>10}{'whole words':>12}"
            f"{'whole code':>11}{'longest cell':>13}  split"]
    for path in paths:
        sizes = core_sizes(read(path))
        (cw, cl), (ww, wl) = sizes["core"], sizes["whole"]
        rows.append(f"{path.name:<32}{cw:>11}{cl:>10}{ww:>12}{wl:>11}"
                    f"{sizes['longest'][0]:>13}  {'yes' if sizes['split'] else 'not yet'}")
    return "\n".join(rows) + (f"\ntargets for the core path: {CORE_WORDS} words, "
                              f"{CORE_CODE_LINES} code lines; {CELL_LINES} lines per cell")


def format_problems(path: Path, nb, conf: dict) -> list[str]:
    name = path.name
    problems = []
    if not NAME_PATTERN.match(name):
        problems.append(f"{name}: file name should look like NN_short_topic.ipynb")
    info = nb.metadata.get(METADATA_KEY, {})
    if not info.get("title") or not info.get("question"):
        problems.append(f"{name}: metadata.{METADATA_KEY} needs a title and a question")
    for key, value in CANONICAL_METADATA.items():
        if nb.metadata.get(key) != value:
            problems.append(f"{name}: metadata.{key} should be {value}")
    kernelspec = nb.metadata.get("kernelspec", {})
    if {key: kernelspec.get(key) for key in KERNEL} != KERNEL:
        problems.append(f"{name}: metadata.kernelspec should name the kernel {KERNEL}")
    elif kernelspec != NEW_KERNELSPEC:
        problems.append(f"{name}: metadata.kernelspec should be {NEW_KERNELSPEC}, what "
                        "JupyterLab writes (any other: modified as it opens, then autosaved)")
    cells = nb.cells
    if not cells or cells[0].cell_type != "markdown" or cells[0].source != header_source(
            name, nb, conf):
        problems.append(f"{name}: the first cell should be the canonical header with the "
                        "Colab badge")
    setup = setup_source(conf, setup_modules(nb))  # checkup.py too, for a notebook importing it
    if len(cells) < 2 or not is_setup_cell(cells[1]) or cells[1].source != setup \
            or CPU_OK_TAG not in cells[1].metadata.get("tags", []):
        problems.append(f"{name}: the second cell should be the canonical set-up cell, tagged "
                        f"{SETUP_TAG} and {CPU_OK_TAG}")
    return (problems + solution_problems(name, nb) + teaching_problems(name, nb)
            + figure_problems(name, nb) + issue_link_problems(name, nb)
            + prediction_problems(name, nb) + bookkeeping_problems(name, nb)
            + fold_label_problems(name, nb)
            + core_problems(name, nb))


def fix(nb, path: Path, conf: dict) -> None:
    """Rewrite the header, the set-up cell and the Colab metadata into canonical form."""
    for key, value in CANONICAL_METADATA.items():
        nb.metadata[key] = value
    nb.metadata["kernelspec"] = dict(NEW_KERNELSPEC)
    header = nbformat.v4.new_markdown_cell(header_source(path.name, nb, conf))
    if nb.cells and nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "):
        nb.cells[0].source = header.source
    else:
        nb.cells.insert(0, header)
    for i in answer_cells(nb):
        nb.cells[i].metadata.setdefault("jupyter", {})["source_hidden"] = True
        nb.cells[i].source = labelled(nb.cells[i].source, ANSWER_LABEL)
    setup = setup_source(conf, setup_modules(nb))
    if len(nb.cells) > 1 and is_setup_cell(nb.cells[1]):
        nb.cells[1].source = setup
    else:
        nb.cells.insert(1, nbformat.v4.new_code_cell(setup))
    tags = nb.cells[1].metadata.setdefault("tags", [])
    for tag in (SETUP_TAG, CPU_OK_TAG):
        if tag not in tags:
            tags.append(tag)
    for cell in nb.cells:
        if is_solution_cell(cell):
            cell.metadata.setdefault("jupyter", {}).update(source_hidden=True,
                                                           outputs_hidden=True)
            cell.metadata["cellView"] = "form"
            if cell.source.startswith("# Solution\n"):
                cell.source = SOLUTION_TITLE + cell.source[len("# Solution"):]
        if cell.cell_type == "markdown":
            cell.source = linked_issues(cell.source)
        if is_short_answer(cell):
            cell.metadata.setdefault("jupyter", {})["source_hidden"] = True
            cell.source = labelled(cell.source, SHORT_ANSWER)
    for _, cell in _core_cells(nb):
        if is_bookkeeping_cell(cell):
            cell.metadata.setdefault("jupyter", {}).update(source_hidden=True,
                                                           outputs_hidden=True)
            cell.metadata["cellView"] = "form"


# ---------------------------------------------------------------------------- recorded results


def outputs_metadata(nb, kind: str) -> list[dict]:
    """Every ``kind`` ("measurement" or "claim") that helpers.record/claim left in outputs."""
    found = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            entry = output.get("metadata", {}).get(METADATA_KEY, {}).get(kind)
            if entry is not None:
                found.append(entry)
    return found


def measurement_text(m: dict) -> str:
    """A recorded value as the notebook printed it and the README quotes it."""
    from helpers import format_value  # the notebooks' own formatting of recorded values

    return f"{m['label']}: {format_value(m['value'], m['unit'])}"


def headline_texts(nb) -> list[str]:
    return [measurement_text(m) for m in outputs_metadata(nb, "measurement") if m.get("headline")]


def run_text(stamp: dict) -> str:
    """Where a committed run was made: GPU, torch and CUDA, Python."""
    return (f"{stamp['gpu']}, torch {stamp['torch']} (CUDA {stamp['cuda']}), "
            f"Python {stamp['python']}")


ANSWERS_FOLD = ("<details>\n<summary>{summary} (answers to the notebooks' predictions: open "
                "them after you have predicted)</summary>\n\n{body}\n\n</details>")


def readme_table(paths: list[Path], conf: dict) -> str:
    """The README's notebook table, and each notebook's headline results folded below it: they
    answer the predictions, so a reader meets them only on a click."""
    rows = ["| # | notebook: the question | run it yourself |", "|---|---|---|"]
    results, runs = [], set()
    for path in paths:
        nb = read(path)
        info = nb.metadata.get(METADATA_KEY, {})
        needs = info.get("requires_gpus", 1)
        needs = f" *Needs {needs} GPUs.*" if needs > 1 else ""
        rows.append(f"| {path.name[:2]} | [{info.get('title', path.stem)}](notebooks/"
                    f"{path.name}): {info.get('question', '')}{needs} | "
                    f"[![Open In Colab]({COLAB_BADGE})]({run_url(path.name, conf)}) |")
        results.append(f"- {path.name[:2]}: " + ("; ".join(headline_texts(nb)) or "not run yet"))
        stamp = info.get("provenance")
        if stamp:
            runs.add(run_text(stamp))
    source = "; ".join(sorted(runs)) or "no notebook has been executed yet"
    folded = ANSWERS_FOLD.format(summary="The headline results of the committed runs",
                                 body="\n".join(results))
    return "\n".join(rows) + f"\n\n{folded}\n\nCommitted outputs come from: {source}."


def gpu_label(name: str | None) -> str:
    """A stamp's GPU in a table cell: "NVIDIA H100 80GB HBM3" as "H100", "2 x NVIDIA H200" as
    "H200"."""
    if not name:
        return "?"
    words = name.split(" x ")[-1].removeprefix("NVIDIA ").split()
    return words[0] if words else "?"


def _minutes(nb) -> float | None:
    stamp = nb.metadata.get(METADATA_KEY, {}).get("provenance")
    return None if not stamp else stamp["wall_seconds"] / 60


DISCUSSION_MINUTES = 10  # a notebook's prediction and discussion in a workshop
BRIEF_MINUTES = 5  # a notebook shown in brief: its question, the room's guesses, its headline
SETUP_MINUTES = 10  # a workshop's start: open the notebook on Colab, connect a GPU, set up
BREAK_MINUTES = 10


def prerequisites(number: str, builds_on: dict[str, list[str]]) -> dict[str, int]:
    """Every notebook ``number`` builds on: 1 directly, 2 through one other, and so on (the
    fewest steps)."""
    steps, frontier = {}, [number]
    while frontier:
        frontier = sorted({other for n in frontier for other in builds_on.get(n, [])
                           if other not in steps and other != number})
        steps.update({other: 1 + max(steps.values(), default=0) for other in frontier})
    return steps


def agenda(minutes: float, reaches: str, costs: dict[str, float],
           builds_on: dict[str, list[str]]) -> list[tuple[str, str]]:
    """The notebooks of a workshop of ``minutes`` (set-up and a break included) that reaches
    notebook ``reaches``: it and every notebook it builds on, in reading order, each as "core
    path" (its cost in ``costs``) or "in brief" (BRIEF_MINUTES). ``reaches`` is taken whole,
    then what it builds on, the closest first, each where it still fits."""
    steps = prerequisites(reaches, builds_on)
    needed = set(steps)
    room = minutes - SETUP_MINUTES - BREAK_MINUTES
    spent = costs[reaches] + BRIEF_MINUTES * len(needed)
    if spent > room:
        raise ValueError(f"{minutes} minutes cannot reach {reaches}: it and what it builds on "
                         f"in brief take {spent + SETUP_MINUTES + BREAK_MINUTES:.0f}")
    whole = {reaches}
    for number in sorted(needed, key=lambda n: (steps[n], n)):
        if spent - BRIEF_MINUTES + costs[number] <= room:
            whole.add(number)
            spent += costs[number] - BRIEF_MINUTES
    return [(n, "core path" if n in whole else "in brief") for n in sorted(needed | {reaches})]


def schedule(taken: list[tuple[str, str]], costs: dict[str, float]) -> list[tuple[str, float]]:
    """A workshop's slots with their minutes: the set-up, the notebooks, and a break at the
    notebook boundary nearest the middle."""
    slots = [("set-up", SETUP_MINUTES)]
    slots += [(f"{n} ({how})", costs[n] if how == "core path" else BRIEF_MINUTES)
              for n, how in taken]
    total = sum(m for _, m in slots) + BREAK_MINUTES
    ends = [sum(m for _, m in slots[:i + 1]) for i in range(len(slots))]
    middle = min(range(1, len(slots)), key=lambda i: abs(ends[i] - total / 2))
    return slots[:middle + 1] + [("break", BREAK_MINUTES)] + slots[middle + 1:]


def _clock(minutes: float) -> str:
    return f"{int(minutes // 60)}:{int(minutes % 60):02d}"


def agenda_line(name: str, budget: dict, costs: dict[str, float], reading: dict[str, float],
                gpu: dict[str, float], builds_on: dict[str, list[str]]) -> str:
    """One agenda of the README: its slots with their start times, and what its time is."""
    taken = agenda(budget["minutes"], budget["reaches"], costs, builds_on)
    slots, start, shown = schedule(taken, costs), 0.0, []
    for what, length in slots:
        shown.append(f"{_clock(start)} {what}")
        start += length
    whole = [n for n, how in taken if how == "core path"]
    return (f"- **{name}**, reaching {budget['reaches']}: " + " · ".join(shown)
            + f" · {_clock(start)} end ({start:.0f} of {budget['minutes']} minutes: "
            f"{sum(reading[n] for n in whole):.0f} of reading on the core paths, "
            f"{DISCUSSION_MINUTES * len(whole)} of discussion, "
            f"{sum(gpu[n] for n in whole):.1f} of GPU time as the committed runs measured it)")


def teaching_section(paths: list[Path], conf: dict) -> str:
    """The syllabus, the agendas and the rules of thumb, from the notebooks' metadata and
    their recorded measurements: regenerated, never typed."""
    notebooks = {path.name[:2]: (path, read(path)) for path in paths}
    rows = ["| # | the question | builds on | concepts | reading, core / whole | "
            "GPU time (committed run, its GPU) |", "|---|---|---|---|---|---|"]
    reading = {}
    for number, (path, nb) in notebooks.items():
        info = nb.metadata.get(METADATA_KEY, {})
        minutes = _minutes(nb)
        needs = info.get("requires_gpus", 1)
        gpu_time = "not run yet" if minutes is None else f"{minutes:.1f} min on " + (
            f"{needs} GPUs, " if needs > 1 else "") + gpu_label(info["provenance"].get("gpu"))
        sizes = core_sizes(nb)
        reading[number] = reading_minutes(*sizes["core"])
        whole = reading_minutes(*sizes["whole"])
        rows.append(f"| [{number}](notebooks/{path.name}) | {info.get('question', '')} | "
                    f"{', '.join(info.get('builds_on', [])) or '-'} | "
                    f"{', '.join(info.get('concepts', []))} | "
                    f"{reading[number]:.0f} / {whole:.0f} min | {gpu_time} |")
    agendas = ["", f"Reading time counts {WORDS_A_MINUTE} words or {CODE_LINES_A_MINUTE} lines "
               "of code a minute; the core path is what comes before a notebook's "
               f"\"{GOING_FURTHER[3:]}\" section (the whole notebook where it has none yet).",
               "", "Suggested agendas, computed to fit their time and to reach the notebook "
               f"each names: {SETUP_MINUTES} minutes to set up (open the notebook on Colab, "
               f"connect a GPU, run the set-up cell) and a {BREAK_MINUTES}-minute break; that "
               "notebook and what it builds on closest to it each as a core path (read, "
               f"{DISCUSSION_MINUTES} minutes of prediction and discussion, and its GPU time: "
               "the committed run's wall time, on the GPU named in the table above); the "
               f"others in brief ({BRIEF_MINUTES} minutes: the question, the room's guesses, "
               "the headline and the figure). Times are from the start:", ""]
    costs = {n: reading[n] + DISCUSSION_MINUTES + (_minutes(nb) or 0)
             for n, (_, nb) in notebooks.items()}
    gpu = {n: _minutes(nb) or 0 for n, (_, nb) in notebooks.items()}
    builds_on = {n: nb.metadata.get(METADATA_KEY, {}).get("builds_on", [])
                 for n, (_, nb) in notebooks.items()}
    for name, budget in conf.get("agendas", {}).items():
        agendas.append(agenda_line(name, budget, costs, reading, gpu, builds_on))
    rules = []
    for number, (path, nb) in notebooks.items():
        measured = {m["key"]: m for m in outputs_metadata(nb, "measurement")}
        for rule in nb.metadata.get(METADATA_KEY, {}).get("rules", []):
            m = measured.get(rule["evidence"])
            evidence = measurement_text(m) if m else "not measured yet"
            rules.append(f"- {rule['rule']} *{evidence}* ([{number}](notebooks/{path.name}))")
    folded = ANSWERS_FOLD.format(summary="The rules of thumb, each with the measurement behind "
                                 "it", body="\n".join(rules))
    return "\n".join(rows + agendas + ["", "### Rules of thumb", "", "Each rule cites the "
                                        "measurement that supports it, from the notebook's "
                                        "committed run; [SHEET.md](SHEET.md) lists them without "
                                        "their numbers.", "", folded])


def _replace_between(text: str, start_mark: str, end_mark: str, body: str) -> str:
    start, end = text.index(start_mark) + len(start_mark), text.index(end_mark)
    return text[:start] + "\n" + body + "\n" + text[end:]


def readme_with_table(text: str, table: str) -> str:
    return _replace_between(text, TABLE_START, TABLE_END, table)


SHEET = ROOT / "SHEET.md"  # the one-page sheet: the data path drawn, the rules as a checklist
SHEET_FIGURE = "figures/sheet_data_path.svg"  # drawn by hand, not by a notebook


SHEET_ALT = ("The data path: pageable host memory is copied into pinned memory, from which a "
             "copy engine moves it over the link into device memory; on a side stream the copy "
             "of the next batch hides behind the current step")
SHEET_CAPTION = "The data path from host memory to the GPU, and a copy hiding behind compute."


def sheet_markdown(paths: list[Path], site: bool = False) -> str:
    """The one-page sheet for a workshop's room: the data path, and every notebook's rules of
    thumb as a checklist (without their numbers, which are the notebooks' answers). For the
    site (``site``), the drawing is a captioned figure."""
    drawing = (f"```{{figure}} {SHEET_FIGURE}\n:alt: {SHEET_ALT}\n:width: 100%\n\n"
               f"{SHEET_CAPTION}\n```" if site else f"![{SHEET_ALT}]({SHEET_FIGURE})")
    lines = ["# Host memory to GPU and back, on one page", "", drawing, "",
             "## Checklist", "",
             "Each rule is measured in the notebook named after it. Generated from the notebooks "
             "by `python tools/nbtool.py check --fix`; the numbers behind each rule are in the "
             "README and in the notebooks.", ""]
    for path in paths:
        nb = read(path)
        for rule in nb.metadata.get(METADATA_KEY, {}).get("rules", []):
            lines.append(f"- [ ] {rule['rule']} ([{path.name[:2]}](notebooks/{path.name}))")
    return "\n".join(lines) + "\n"


def current_readme(text: str, paths: list[Path], conf: dict) -> str:
    """The README with its generated sections (notebook table, teaching, margins)
    regenerated."""
    text = readme_with_table(text, readme_table(paths, conf))
    text = _replace_between(text, MARGINS_START, MARGINS_END, margins_table(paths))
    return _replace_between(text, TEACHING_START, TEACHING_END, teaching_section(paths, conf))


# ---------------------------------------------------------------------------- margins
#
# A claim's margin is how far its measured value is from failing: lhs / threshold for > and >=,
# threshold / lhs for < and <= (1.0: at the threshold; under 1: failed). Runs are recorded by
# tools/claim_log.py in a notebook's kernel, either by `margins` (claims recorded, not raised)
# or by pytest with COLLECTION_CLAIM_LOG set (nbval as CI runs it); MARGINS keeps every run, and
# the report counts a run only while the notebook's code and what it reaches of helpers.py are
# the ones that ran. The committed outputs are a run too, with all CPUs.

MARGINS = ROOT / "tests" / "margins.json"
MARGIN_BAR = 1.10  # every timing claim's worst margin, over every current run (issue 32)
MARGIN_RUNS = 3  # runs per host shape: all CPUs, and 2 CPUs (a free Colab runtime's)
TIMING_UNITS = frozenset({"ms", "s", "us", "GB/s", "batches/s", "x", "%"})
# Ratios in "x" or "%" that no clock enters: sizes the allocator, the page cache or the disk
# decide, the same on every run of one host.
NOT_TIMING = frozenset({
    "rounding_33mib",  # 01: the caching host allocator's power-of-two rounding
    "worst_peak_ratio",  # 11: peak GPU memory
    "cpu_build_host_peak", "gpu_build_gpu_peak", "meta_gpu_peak",  # 12: peak memory
    "cold_disk_share", "warm_disk_share",  # 12: bytes the kernel counted as read from the disk
    "exercise_pinned_ratio",  # 06: pinned bytes held against the prediction
    "pins_inside_next_share",  # 06: the share of pin_memory() calls made inside next()
    # 14: GPU memory freed or kept, over the state's size (the allocator's and driver's counts)
    "partial_freed", "allocated_freed", "free_while_cached", "free_after_empty",
})
MARGINS_START, MARGINS_END = "<!-- margins:start -->", "<!-- margins:end -->"


def run_version(nb, helpers_text: str | None = None, hashed=runnable_text) -> str:
    """What a margin run depends on: the notebook's code and what of helpers.py it reaches
    (and of checkup.py, where it imports that)."""
    reach = json.dumps(helpers_reach(nb, helpers_text, hashed), sort_keys=True)
    siblings = sibling_stamps(nb, hashed=hashed)
    if siblings:  # a notebook that imports no module beside helpers.py keeps its version
        reach += "\n" + json.dumps(siblings, sort_keys=True)
    return hashlib.sha256(f"{code_sha256(nb, hashed)}\n{reach}".encode()).hexdigest()[:16]


def claim_margin(op: str, lhs: float, threshold: float) -> float:
    """How far ``lhs op threshold`` is from failing, as a ratio (inf: it cannot fail by
    scaling, e.g. a zero where at most some is allowed; 0: it failed outright)."""
    greater = op.startswith(">")
    numerator, denominator = (lhs, threshold) if greater else (threshold, lhs)
    holds = (lhs > threshold if op == ">" else lhs >= threshold if op == ">="
             else lhs < threshold if op == "<" else lhs <= threshold)
    if denominator > 0 and numerator >= 0:
        return numerator / denominator
    return float("inf") if holds else 0.0


def is_timing_claim(claim: dict) -> bool:
    """A claim on a measured time or rate (or a share or ratio of them), as opposed to an
    exact one: a count, a size, a yes/no."""
    if claim.get("exact") or claim["lhs"] in NOT_TIMING or claim["rhs"] in NOT_TIMING:
        return False
    units = {claim.get("lhs_unit"), claim.get("rhs_unit")} - {None}
    if units & TIMING_UNITS:
        return True
    values = (claim.get("lhs_value"), claim.get("rhs_value"))
    return units <= {""} and any(v is not None and not float(v).is_integer() for v in values)


def committed_run(path: Path, nb) -> dict | None:
    """The committed outputs' claims as a margin run (the executor runs with every CPU)."""
    stamp = nb.metadata.get(METADATA_KEY, {}).get("provenance")
    if not stamp:
        return None
    measured = {m["key"]: m for m in outputs_metadata(nb, "measurement")}
    claims = []
    for found in outputs_metadata(nb, "claim"):
        line = dict(found, applies=found.get("applies", True))
        if line["applies"]:
            for side in ("lhs", "rhs"):
                key = found[side]  # a recorded key, a number, or None: lhs_value holds it
                value = (measured.get(key) if isinstance(key, str)
                         else {"value": key if key is not None else found.get(f"{side}_value")})
                value = None if value is None or value["value"] is None else value
                line[f"{side}_value"] = None if value is None else float(value["value"])
                line[f"{side}_unit"] = None if value is None else value.get("unit")
            line["holds"] = True  # a committed run stops at a claim that fails
        claims.append(line)
    return {"run": f"committed-{stamp.get('date')}", "notebook": path.name,
            "version": run_version(nb), "source": "committed", "gpu": stamp.get("gpu"),
            "usable_cpus": stamp.get("usable_cpus"), "host_cpus": stamp.get("host_cpus"),
            "torch": stamp.get("torch"), "date": stamp.get("date"), "claims": claims}


def runs_from_log(lines: list[dict]) -> list[dict]:
    """Group a claim log's lines (tools/claim_log.py) into runs, one per kernel."""
    runs: dict[str, dict] = {}
    claim_fields = ("statement", "lhs", "op", "rhs", "factor", "lhs_value", "lhs_unit",
                    "rhs_value", "rhs_unit", "holds", "applies", "reason", "exact")
    for line in lines:
        run = runs.setdefault(line["run"], {k: v for k, v in line.items()
                                            if k not in claim_fields} | {"claims": []})
        run["claims"].append({k: line[k] for k in claim_fields if k in line})
    return list(runs.values())


def read_margins(path: Path | None = None) -> list[dict]:
    path = path or MARGINS
    return json.loads(path.read_text(encoding="utf-8"))["runs"] if path.exists() else []


def write_margins(runs: list[dict], path: Path | None = None) -> None:
    runs = sorted(runs, key=lambda r: (r["notebook"], r.get("date") or "", r["run"]))
    (path or MARGINS).write_text(json.dumps({"runs": runs}, indent=1) + "\n", encoding="utf-8")


def add_runs(new: list[dict], path: Path | None = None) -> int:
    """Keep ``new`` runs in the margins file (a run already kept is not added twice)."""
    runs = read_margins(path)
    known = {r["run"] for r in runs}
    added = [r for r in new if r["run"] not in known and r.get("notebook")]
    write_margins(runs + added, path)
    return len(added)


def host_shape(run: dict) -> str:
    """"all CPUs" or "N CPUs" (a run under taskset); the committed run is made with all."""
    usable, total = run.get("usable_cpus"), run.get("host_cpus")
    if usable is None or usable == total:
        return "all CPUs"
    return f"{usable} CPUs"


SET_ASIDE = "set_aside"  # a run's key: why its claims count toward no margin


def set_aside(run_ids: list[str], why: str, path: Path | None = None) -> int:
    """Keep these runs in the margins file but out of every margin, with the reason: a run made
    against the collection's own rules (08 and 12 measure host memory bandwidth, so a run of
    either beside another notebook on one host measures the neighbours too). Refuses an unknown
    run and an empty reason; a run set aside stays listed, so the record shows what was left out."""
    if not why.strip():
        raise ValueError("say why these runs are set aside")
    runs = read_margins(path)
    known = {r["run"] for r in runs}
    unknown = sorted(set(run_ids) - known)
    if unknown:
        raise ValueError(f"no such run in the margins file: {', '.join(unknown)}")
    for run in runs:
        if run["run"] in run_ids:
            run[SET_ASIDE] = why.strip()
    write_margins(runs, path)
    return len(set(run_ids))


def current_runs(path: Path, nb, runs: list[dict]) -> list[dict]:
    """The runs of this notebook's current version, the committed outputs first; runs set aside
    (``set_aside``) are not among them."""
    version = run_version(nb)
    mine = [r for r in runs if r["notebook"] == path.name and r.get("version") == version
            and not r.get(SET_ASIDE)]
    committed = committed_run(path, nb)
    return ([committed] if committed else []) + mine


@dataclass
class ClaimMargins:
    """One claim over a notebook's runs."""

    statement: str
    timing: bool
    margins: list[float]  # one per run where it applied and was measured
    shapes: list[str]
    values: list[float]
    threshold: str

    @property
    def worst(self) -> float:
        return min(self.margins, default=float("inf"))

    @property
    def median(self) -> float:
        ordered = sorted(self.margins)
        return ordered[len(ordered) // 2] if ordered else float("inf")


def claim_margins(runs: list[dict]) -> list[ClaimMargins]:
    """Each claim's margins over ``runs``, in the notebook's order."""
    by_claim: dict[tuple, ClaimMargins] = {}
    for run in runs:
        for claim in run["claims"]:
            key = (claim["statement"], claim["lhs"])
            rhs = claim["rhs"]
            threshold = (f"{claim['op']} {claim['factor']:g} x {rhs}" if isinstance(rhs, str)
                         else f"{claim['op']} {claim['factor'] * rhs:g}")
            found = by_claim.setdefault(key, ClaimMargins(claim["statement"], False, [], [], [],
                                                          threshold))
            if not claim.get("applies", True) or claim.get("lhs_value") is None \
                    or claim.get("rhs_value") is None:
                continue
            found.timing = found.timing or is_timing_claim(claim)
            found.margins.append(claim_margin(claim["op"], claim["lhs_value"],
                                              claim["factor"] * claim["rhs_value"]))
            found.shapes.append(host_shape(run))
            found.values.append(claim["lhs_value"])
    return list(by_claim.values())


def _margin_text(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.3f}"


def margins_report(paths: list[Path], runs: list[dict] | None = None) -> str:
    """Per notebook and claim: the threshold, the measured values' range, and the worst and
    median margin over the current runs, with how many runs of each host shape."""
    runs = read_margins() if runs is None else runs
    lines = []
    for path in paths:
        nb = read(path)
        mine = current_runs(path, nb, runs)
        shapes = collections.Counter(host_shape(r) for r in mine)
        gpus = sorted({r.get("gpu") or "?" for r in mine})
        version = run_version(nb)
        aside = [r for r in runs if r["notebook"] == path.name and r.get(SET_ASIDE)
                 and r.get("version") == version]
        lines.append(f"{path.name}: " + (", ".join(f"{n} run(s) with {s}"
                                                    for s, n in sorted(shapes.items()))
                                          or "no current run") + f" on {', '.join(gpus)}"
                     + "".join(f"; {n} run(s) set aside: {why}" for why, n in
                               collections.Counter(r[SET_ASIDE] for r in aside).items()))
        for c in claim_margins(mine):
            if not c.margins:
                lines.append(f"  {'-':>7} {'-':>7}  {'not measured':<11} {c.statement}")
                continue
            kind = "timing" if c.timing else "exact"
            spread = f"{min(c.values):.4g}..{max(c.values):.4g}"
            flag = "  <-- under the bar" if c.timing and c.worst < MARGIN_BAR else ""
            lines.append(f"  {_margin_text(c.worst):>7} {_margin_text(c.median):>7}  "
                         f"{kind:<6} {c.statement} [lhs {spread}, {c.threshold}]{flag}")
    return "\n".join(["worst  median  kind   claim [measured range, threshold]"] + lines)


def margins_summary(path: Path, nb, runs: list[dict]) -> dict:
    """A notebook's runs per host shape and its worst timing claim."""
    mine = current_runs(path, nb, runs)
    timing = [c for c in claim_margins(mine) if c.timing and c.margins]
    worst = min(timing, key=lambda c: c.worst, default=None)
    return {"shapes": collections.Counter(host_shape(r) for r in mine),
            "gpus": sorted({r.get("gpu") or "?" for r in mine}),
            "worst": worst, "timing_claims": len(timing),
            "exact_claims": sum(1 for c in claim_margins(mine) if not c.timing and c.margins)}


def margins_table(paths: list[Path], runs: list[dict] | None = None) -> str:
    """The README's table: per notebook, its runs and its worst timing margin."""
    runs = read_margins() if runs is None else runs
    rows = ["| # | runs: all CPUs / 2 CPUs | claims: timing / exact | worst timing margin "
            "(the claim) |", "|---|---|---|---|"]
    for path in paths:
        s = margins_summary(path, read(path), runs)
        worst = "-" if s["worst"] is None else \
            f"{_margin_text(s['worst'].worst)} ({s['worst'].statement})"
        rows.append(f"| {path.name[:2]} | {s['shapes'].get('all CPUs', 0)} / "
                    f"{s['shapes'].get('2 CPUs', 0)} | {s['timing_claims']} / "
                    f"{s['exact_claims']} | {worst} |")
    return "\n".join(rows)


def claim_log_module():
    """tools/claim_log.py, imported by its path (tools/ need not be on sys.path)."""
    import importlib.util

    if "claim_log" not in sys.modules:
        spec = importlib.util.spec_from_file_location("claim_log", ROOT / "tools" / "claim_log.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["claim_log"] = module
    return sys.modules["claim_log"]


def claim_log_environment(log: Path, nb_path: Path, nb, source: str, record: bool,
                          ipython_dir: Path) -> dict[str, str]:
    """The environment variables under which a kernel logs its claims to ``log``."""
    claim_log = claim_log_module()
    claim_log.startup_profile(ipython_dir, ROOT)
    return {"IPYTHONDIR": str(ipython_dir), claim_log.LOG: str(log),
            claim_log.NOTEBOOK: nb_path.name, claim_log.VERSION: run_version(nb),
            claim_log.SOURCE: source, claim_log.MODE: "record" if record else "raise"}


def execute_for_margins(path: Path, log: Path, timeout: int = 600) -> None:
    """Run a notebook in a fresh kernel with its claims recorded, not raised, into ``log``;
    the notebook, its outputs and the committed figures are left as they are."""
    from nbclient import NotebookClient

    nb = read(path)
    with tempfile.TemporaryDirectory(prefix="margins-") as scratch:
        env = claim_log_environment(log, path, nb, "margins", True, Path(scratch) / "ipython")
        env["COLLECTION_FIGURES_DIR"] = str(Path(scratch) / "figures")
        env["COLLECTION_GUESSES"] = "skip"
        with kernel_environment(env):
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()


def read_claim_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line]


def _margins(paths: list[Path], runs: int, cpus: str | None, add: list[Path],
             report_only: bool) -> int:
    """The `margins` command: execute and record, add recorded logs, then report."""
    for log in add:
        print(f"{log}: {add_runs(runs_from_log(read_claim_log(log)))} run(s) added")
    if not report_only and not add:
        if cpus:  # the kernels started from here inherit this affinity (as under taskset)
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        with tempfile.TemporaryDirectory(prefix="claims-") as scratch:
            log = Path(scratch) / "claims.jsonl"
            for path in paths:
                for index in range(runs):
                    print(f"{path.name}: run {index + 1} of {runs} ...", flush=True)
                    start = time.perf_counter()
                    execute_for_margins(path, log)
                    print(f"  {time.perf_counter() - start:.1f} s", flush=True)
            if log.exists():
                print(f"{add_runs(runs_from_log(read_claim_log(log)))} run(s) added to "
                      f"{MARGINS.relative_to(ROOT)}")
    print(margins_report(paths))
    return 0


# ---------------------------------------------------------------------------- the site

SITE = ROOT / "_site"  # the built site (ignored by git)
SITE_CONFIG = ROOT / "tools" / "site"  # Sphinx's conf.py, the stylesheet, the local badge
SITE_BADGE = "/_assets/colab-badge.svg"  # the badge, served by the site itself (srcdir-absolute)
HIDE_TAG = "hide-cell"  # myst-nb folds a cell so tagged, source and outputs, behind a click
REMOVE_OUTPUT_TAG = "remove-output"  # myst-nb leaves out the outputs of a cell so tagged
REMOVE_INPUT_TAG = "remove-input"  # ... or its source
ANSWER_SUMMARY = "Show the answer"  # the fold of the answer in words, after a solution
_RELATIVE_LINK = re.compile(r"(\]\()(?!https?:|mailto:|#)([^)\s#]+)(#[^)\s]*)?(\))")
#: A line of a text output is a table row when a run of two or more spaces separates two of its
#: non-space characters (columns aligned with spaces). The site never wraps a table row (a table
#: wider than the column scrolls sideways in its own box) and wraps any other line (prose).
TABLE_ROW = re.compile(r"\S {2,}\S")
TABLE_ROW_CLASS = "table-row"  # the span finish_site puts each table row in (site.css: nowrap)


def site_title() -> str:
    """The site's title: the README's first heading."""
    first = README.read_text(encoding="utf-8").splitlines()[0]
    return first.removeprefix("# ").strip()


def site_page(path: Path) -> str:
    """Where a notebook's page lies in the built site, relative to its root."""
    return f"notebooks/{path.stem}.html"


def provenance_markdown(name: str, nb, conf: dict) -> str:
    stamp = nb.metadata.get(METADATA_KEY, {}).get("provenance")
    link = f"The notebook: [`notebooks/{name}` on GitHub]({github_url('notebooks/' + name, conf)})."
    if not stamp:
        body = "This notebook has not been run yet: it has no outputs."
    else:
        body = (f"Every output on this page comes from the committed run, not from building the "
                f"site: **{stamp['gpu']}**, torch {stamp['torch']} (CUDA {stamp['cuda']}), "
                f"Python {stamp['python']}, on {stamp['date']}, {stamp['wall_seconds']:g} s "
                "from first cell to last.")
        headlines = headline_texts(nb)
        if headlines:
            body += "\n\nIts headline result: " + "; ".join(headlines) + "."
    return f"```{{admonition}} The committed run\n:class: provenance\n\n{body}\n\n{link}\n```"


def _is_text_display(output) -> bool:
    return output.get("output_type") == "display_data" and set(output.get("data", {})) == {
        "text/plain"}


def merged_text_displays(outputs: list) -> list:
    """``outputs`` with each run of plain-text displays (a cell's ``helpers.record`` and
    ``helpers.claim`` lines) joined into one, shown as one block instead of one box a line."""
    merged = []
    for output in outputs:
        if merged and _is_text_display(output) and _is_text_display(merged[-1]):
            last = copy.deepcopy(merged[-1])
            last["data"]["text/plain"] = (f"{last['data']['text/plain'].rstrip()}\n"
                                          f"{output['data']['text/plain']}")
            merged[-1] = last
        else:
            merged.append(output)
    return merged


def figure_cells(cell) -> list:
    """A code cell as the site shows it: each figure alone in a cell with its alt text and
    caption (myst-nb's cell metadata applies to every output of a cell), the other outputs
    around it in cells of their own, all but the first without the (repeated) source."""
    texts = iter(figure_texts(cell))
    if not figure_texts(cell):
        return [cell]
    parts, current = [], copy.deepcopy(cell)
    current.outputs = []

    def continuation():  # myst-nb skips a cell without source, outputs and all
        return nbformat.v4.new_code_cell("# (outputs of the cell above, continued)",
                                         metadata={"tags": [REMOVE_INPUT_TAG]})

    for output in cell.outputs:
        if "image/png" not in output.get("data", {}):
            current.outputs.append(output)
            continue
        if current.outputs:
            parts.append(current)
            current = continuation()
        text = next(texts)
        current.outputs = [output]
        current.metadata["mystnb"] = {"image": {"alt": text["alt"]},
                                      "figure": {"caption": text["caption"],
                                                 "name": f"fig-{text['name']}"}}
        parts.append(current)
        current = continuation()
    if current.outputs:
        parts.append(current)
    return parts


def site_notebook(nb, name: str, conf: dict):
    """The copy of a notebook that the site shows: its solutions folded (the committed ones
    stay as they are), each figure captioned, a cell's record lines in one block, the set-up
    cell without its output (what it installed: nothing, outside Colab), the badge served
    locally, the provenance (from the committed outputs, before any of this) under the header."""
    provenance = provenance_markdown(name, nb, conf)
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if is_solution_cell(cell):
            cell.metadata.setdefault("tags", []).append(HIDE_TAG)
        if is_setup_cell(cell):
            cell.metadata.setdefault("tags", []).append(REMOVE_OUTPUT_TAG)
        if cell.cell_type == "code":
            cell.outputs = merged_text_displays(cell.get("outputs", []))
    nb.cells = [part for cell in nb.cells for part in figure_cells(cell)]
    fold_answers_in_words(nb)  # folded as a solution is, behind a click
    for cell in nb.cells:
        if is_bookkeeping_cell(cell) and is_folded(cell):
            cell.metadata.setdefault("tags", []).append(HIDE_TAG)
            cell.metadata.setdefault("mystnb", {}).update(code_prompt_show=CHECKS_PROMPT,
                                                          code_prompt_hide="Hide them")
    nb.cells[0].source = nb.cells[0].source.replace(COLAB_BADGE, SITE_BADGE)
    nb.cells.insert(1, nbformat.v4.new_markdown_cell(provenance))
    return nb


MAINTAINERS_FROM = "## Test"  # the README's sections from here on are for maintainers
_README_FIGURE = re.compile(r"^!\[([^\]\n]+)\]\((figures/([\w-]+)\.png)\)[ \t]*$", re.M)


def site_landing_figures(text: str, paths: list[Path]) -> str:
    """``text`` with each figure that stands alone on its line (``![alt](figures/NAME.png)``)
    as a figure the column's width, captioned as the notebook that draws it captions it, with a
    link to that notebook."""
    drawn = {figure["name"]: (path, figure) for path in paths for cell in read(path).cells
             for figure in figure_texts(cell)}

    def figure(match: re.Match) -> str:
        alt, target, name = match.groups()
        if name not in drawn or not drawn[name][1].get("caption"):
            return match.group(0)
        path, texts = drawn[name]
        return (f"```{{figure}} {target}\n:alt: {alt}\n:name: landing-{name}\n:width: 100%\n\n"
                f"From [notebook {path.name[:2]}](notebooks/{path.name}): {texts['caption']}\n```")

    return _README_FIGURE.sub(figure, text)


def site_landing_page(readme: str, paths: list[Path], conf: dict) -> str:
    """The README's sections for readers as the site's first page (the notebooks, teaching,
    set-up; testing and building stay on GitHub): notebooks and figures link within the site,
    other files of the repository to GitHub; its figures captioned; a table of contents in
    notebook order."""
    local = {f"notebooks/{p.name}" for p in paths} | {SHEET.name}

    def link(match: re.Match) -> str:
        target = match.group(2)
        if target in local or target.startswith("figures/"):
            return match.group(0)
        return f"{match.group(1)}{github_url(target, conf)}{match.group(3) or ''}{match.group(4)}"

    readers, _, _ = readme.partition(MAINTAINERS_FROM)  # testing and building: on GitHub
    readers += ("## How close the claims come to failing\n\nEach notebook checks its results "
                "with claims; a timing claim's margin is how far its measured value stayed from "
                "failing (1.0: at the threshold), the worst over the recorded runs with all the "
                "host's CPUs and with two (a free Colab runtime's):\n\n"
                f"{margins_table(paths)}\n\nTesting the notebooks, regenerating their outputs "
                f"and building this site: see the [README on GitHub]"
                f"({github_url('README.md', conf)}).\n")
    text = _RELATIVE_LINK.sub(link, readers).replace(COLAB_BADGE, SITE_BADGE)
    text = site_landing_figures(text, paths)
    entries = "\n".join(f"notebooks/{p.stem}" for p in paths)
    return (f"{text.rstrip()}\n\n```{{toctree}}\n:hidden:\n:caption: Notebooks\n\n{entries}\n```"
            f"\n\n```{{toctree}}\n:hidden:\n:caption: For the room\n\n{SHEET.stem}\n```\n")


def stage_site(src: Path, conf: dict) -> None:
    """The site's sources, in ``src``: the landing page, the notebooks' copies, the figures,
    the one-page sheet."""
    paths = notebook_paths()
    (src / "notebooks").mkdir(parents=True)
    for path in paths:
        write(site_notebook(read(path), path.name, conf), src / "notebooks" / path.name)
    shutil.copytree(ROOT / "figures", src / "figures")
    (src / "_assets").mkdir()
    shutil.copy(SITE_CONFIG / "colab-badge.svg", src / "_assets")
    (src / "index.md").write_text(site_landing_page(README.read_text(encoding="utf-8"), paths,
                                                    conf), encoding="utf-8")
    (src / SHEET.name).write_text(sheet_markdown(paths, site=True), encoding="utf-8")


# pydata-sphinx-theme loads Font Awesome twice: as web fonts from its stylesheet, which draw the
# site's icons, and as a 1.5 MB script that only adds custom icons, which the site has none of.
_FONTAWESOME_JS = re.compile(r'\s*<script defer src="[^"]*_static/scripts/fontawesome\.js[^"]*">'
                             r"</script>")


# A text output as myst-nb writes it: an empty span, then the text, HTML-escaped (an output
# with markup in it, colours, is left as it is).
_TEXT_OUTPUT = re.compile(r'(<div class="output [^"]*"><div class="highlight"><pre>'
                          r"<span></span>)([^<]*)(</pre>)")


def site_table_rows(page: str) -> str:
    """``page`` (HTML) with each table row (TABLE_ROW) of its text outputs in a span of class
    TABLE_ROW_CLASS, which site.css never wraps. The rule reads the escaped text: an entity
    (&gt;) holds no space, so a line is a row escaped or not."""
    def rows(match: re.Match) -> str:
        lines = [f'<span class="{TABLE_ROW_CLASS}">{line}</span>' if TABLE_ROW.search(line)
                 else line for line in match.group(2).split("\n")]
        return match.group(1) + "\n".join(lines) + match.group(3)

    return _TEXT_OUTPUT.sub(rows, page)


def finish_site(html: Path) -> None:
    """What the build leaves to do: the header's download button serves the committed notebook
    (not the site's staged copy of it), no page loads the Font Awesome script, and the rows of
    the tables that outputs print are marked (site_table_rows)."""
    for path in notebook_paths():
        shutil.copy(path, html / "_sources" / "notebooks" / path.name)
    for page in html.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        finished = site_table_rows(_FONTAWESOME_JS.sub("", text))
        if finished != text:
            page.write_text(finished, encoding="utf-8")
    for script in (html / "_static" / "scripts").glob("fontawesome.js*"):
        script.unlink()


def build_site(out: Path = SITE) -> Path:
    """Build the site from the committed outputs into ``out`` (replaced); a Sphinx warning fails
    the build."""
    with tempfile.TemporaryDirectory(prefix="site-") as tmp:
        src, html = Path(tmp, "src"), Path(tmp, "html")
        stage_site(src, settings())
        sphinx = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going",
                                 "-q", "-c", str(SITE_CONFIG), "-d", str(Path(tmp, "doctrees")),
                                 str(src), str(html)])
        if sphinx.returncode:
            raise RuntimeError("the site's build failed: see Sphinx's messages above")
        finish_site(html)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(html, out)
    return out


# ---------------------------------------------------------------------------- the lab

# JupyterLab rewrites a notebook it only opened where the kernel's Python differs from the one
# that executed it (tools/lab.py says how); `lab` starts it with tools/lab.py's pre-save hook,
# which saves such a notebook as it was. Any real edit saves as JupyterLab sends it.


def lab_argv(args: list[str]) -> list[str]:
    """``jupyter lab``'s arguments for `lab`: ``args``, then the hook (importable by its name:
    ROOT is on sys.path)."""
    from tools.lab import HOOK

    return [*args, f"--ContentsManager.pre_save_hook={HOOK}"]


def _lab(args: list[str]) -> int:
    """``jupyter lab ARGS`` with the hook, in this process (where the hook imports; its kernels
    start as plain ``jupyter lab`` starts them), until it stops."""
    from jupyterlab.labapp import LabApp

    argv = lab_argv(args)
    print(f"jupyter lab {' '.join(argv)}", flush=True)
    LabApp.launch_instance(argv=argv)
    return 0


# ---------------------------------------------------------------------------- command line


def _check(fix_mode: bool) -> int:
    conf = settings()
    problems = []
    for path in notebook_paths():
        nb = read(path)
        found = format_problems(path, nb, conf)
        if found and fix_mode:
            fix(nb, path, conf)
            write(nb, path)
            found = format_problems(path, read(path), conf)
        problems += found
    readme = README.read_text(encoding="utf-8")
    wanted = current_readme(readme, notebook_paths(), conf)
    if readme != wanted:
        if fix_mode:
            README.write_text(wanted, encoding="utf-8")
        else:
            problems.append("README.md: the notebook table or the teaching section is out of "
                            "date")
    sheet = sheet_markdown(notebook_paths())
    if not SHEET.exists() or SHEET.read_text(encoding="utf-8") != sheet:
        if fix_mode:
            SHEET.write_text(sheet, encoding="utf-8")
        else:
            problems.append("SHEET.md: the one-page sheet is out of date")
    for problem in problems:
        print(problem)
    hint = "" if fix_mode else " (python tools/nbtool.py check --fix rewrites them)"
    print(f"{len(problems)} problem(s){hint}" if problems else "format ok")
    return 1 if problems else 0


def _new(stem: str, title: str, question: str) -> int:
    path = NOTEBOOKS / f"{stem}.ipynb"
    if path.exists():
        raise SystemExit(f"{path} exists")
    nb = nbformat.v4.new_notebook()
    nb.metadata[METADATA_KEY] = {"title": title, "question": question}
    fix(nb, path, settings())
    write(nb, path)
    print(f"created {path.relative_to(ROOT)}")
    return 0


def _migrate_hashes(paths: list[Path]) -> int:
    runs = read_margins()
    refused = 0
    for path in paths or notebook_paths():
        try:
            print(migrate_hashes(path, runs))
        except ValueError as error:
            print(error, file=sys.stderr)
            refused += 1
    write_margins(runs)
    if refused:
        print(f"{refused} notebook(s) refused", file=sys.stderr)
    return 1 if refused else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks with provenance (default: all)")
    run.add_argument("notebooks", nargs="*", type=Path)
    run.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    check = sub.add_parser("check", help="check the notebooks' canonical format")
    check.add_argument("--fix", action="store_true")
    new = sub.add_parser("new", help="create a notebook in the canonical format")
    new.add_argument("stem")
    new.add_argument("title")
    new.add_argument("question")
    sub.add_parser("sizes", help="each notebook's core path and whole size against the targets")
    margins = sub.add_parser("margins", help="execute notebooks with their claims recorded, "
                             "not raised, keep the runs in tests/margins.json and report each "
                             "claim's margin (default: report only, over every notebook)")
    margins.add_argument("notebooks", nargs="*", type=Path)
    margins.add_argument("--runs", type=int, default=0, help="executions per notebook")
    margins.add_argument("--cpus", help="CPU list the kernels may use, as taskset -c takes "
                         "it (0,1: a free Colab runtime's two)")
    margins.add_argument("--add", nargs="*", type=Path, default=[], metavar="LOG",
                         help="claim logs written by pytest with COLLECTION_CLAIM_LOG set")
    margins.add_argument("--set-aside", nargs="+", default=[], metavar="RUN",
                         help="runs to keep out of every margin (listed, with --why)")
    margins.add_argument("--why", default="", help="why the runs are set aside")
    site = sub.add_parser("site", help="build the static site from the committed outputs")
    site.add_argument("--out", type=Path, default=SITE, help="where (default: _site/)")
    blank = sub.add_parser("blank", help="write the notebooks without outputs into OUT/notebooks "
                           "(what the run branch holds)")
    blank.add_argument("out", type=Path)
    migrate = sub.add_parser("migrate-hashes", help="rehash stamps made over the code's text "
                             "(comments included) over its code, with their margin runs")
    migrate.add_argument("notebooks", nargs="*", type=Path)
    reach = sub.add_parser("reach", help="which notebooks the uncommitted changes (or a change "
                           "to a helpers.py unit) make stale, and the device time to re-run them")
    reach.add_argument("--unit", action="append", default=[], metavar="NAME",
                       help="a top-level name of helpers.py or checkup.py (repeatable)")
    reach.add_argument("--since", default="HEAD", metavar="REV",
                       help="compare the working tree with this revision (default: HEAD)")
    jupyter = sub.add_parser("lab", help="JupyterLab that saves a notebook it only opened as it "
                             "was (a kernel on another Python than the notebook's included)")
    jupyter.add_argument("args", nargs="*", metavar="ARG",
                         help="jupyter lab's (its --help-all lists them), passed as given")
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    if args.command == "lab":  # everything after it is jupyter lab's (argparse reorders options)
        return _lab(argv[argv.index("lab") + 1:])
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "migrate-hashes":
        return _migrate_hashes([p.resolve() for p in args.notebooks])
    if args.command == "reach":
        return _reach(args.unit, args.since)
    if args.command == "check":
        return _check(args.fix)
    if args.command == "new":
        return _new(args.stem, args.title, args.question)
    if args.command == "margins":
        paths = [p.resolve() for p in args.notebooks] or notebook_paths()
        if args.set_aside:
            try:
                print(f"{set_aside(args.set_aside, args.why)} run(s) set aside: {args.why}")
            except ValueError as error:
                print(error, file=sys.stderr)
                return 1
        return _margins(paths, args.runs, args.cpus, args.add, report_only=args.runs == 0)
    if args.command == "blank":
        written = write_blank_copies(args.out.resolve())
        print(f"{len(written)} notebooks without outputs in {args.out / 'notebooks'}")
        return 0
    if args.command == "sizes":
        print(sizes_report(notebook_paths()))
        return 0
    if args.command == "site":
        start = time.perf_counter()
        try:
            out = build_site(args.out.resolve())
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        print(f"built {out} in {time.perf_counter() - start:.1f} s; open {out / 'index.html'}")
        return 0
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for path in [p.resolve() for p in args.notebooks] or notebook_paths():
        needed = read(path).metadata.get(METADATA_KEY, {}).get("requires_gpus", 1)
        if visible < needed:  # keep the outputs of the host it needs
            print(f"skipping {path.name}: requires {needed} GPUs, {visible} visible", flush=True)
            continue
        print(f"executing {path.name} ...", flush=True)
        stamp = execute(path, args.timeout)
        print(f"  {stamp['wall_seconds']} s wall, kernel peak RSS "
              f"{stamp['kernel_peak_rss_mib']} MiB, kernel and its children together "
              f"{stamp['process_tree_peak_mib']} MiB (PSS), on {stamp['gpu']}", flush=True)
    README.write_text(current_readme(README.read_text(encoding="utf-8"), notebook_paths(),
                                     settings()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
