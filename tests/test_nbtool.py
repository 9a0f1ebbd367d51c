"""What the provenance stamp hashes (tools/nbtool.py): a notebook's code and the parts of
helpers.py it reaches, each without comments and docstrings; the staleness it reports; the
``migrate-hashes`` step from stamps that hashed the text as written.

A notebook is stale when code of helpers.py that it can reach changed, and only then: these
tests edit a small helpers module in every way that can matter (or must not) and check which
notebooks the edit makes stale.
"""

import copy
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tools import nbtool

MARGINS = nbtool.MARGINS  # the committed runs, whatever root a test gives nbtool

HELPERS = '''\
"""A small helpers module."""

from __future__ import annotations

import os
import json as js

SCALE = 2
UNUSED = 3
LIMIT = 1
LIMIT = 2

if os.environ.get("HELPERS_TEST_FLAG"):
    SCALE = 5


def _inner(x):
    return x * SCALE


def reached(x):
    """Reached from the notebook."""
    return _inner(x) + 1


def unreached(x):
    return x - 1


def encode(value):
    return js.dumps(value)


def floored(x):
    return math.floor(x)


def limit():
    return LIMIT


def everything():
    return sorted(globals())
'''


def notebook(*sources: str):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    return nb


def edited(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def stale(nb, before: str, after: str) -> bool:
    return nbtool.helpers_reach(nb, before) != nbtool.helpers_reach(nb, after)


USES_REACHED = notebook("import helpers\n", "helpers.reached(1)")
USES_UNREACHED = notebook("import helpers\n", "helpers.unreached(1)")
USES_NOTHING = notebook("x = 1")


# ---------------------------------------------------------------------------- units


def test_units_are_the_top_level_statements():
    units = nbtool.helpers_units(HELPERS)
    always = [u for u in units.values() if u.always]
    assert {"reached", "_inner", "SCALE", "os", "js", "LIMIT", "LIMIT #2"} <= set(units)
    assert not any("A small helpers module" in u.source for u in units.values())  # docstring
    assert len(always) == 2  # from __future__ and the `if`
    assert all(u.key.startswith("<statement: ") for u in always)
    assert units["reached"].source.startswith("def reached(x):\n")
    assert units["reached"].source.endswith("return _inner(x) + 1\n")
    assert units["reached"].deps == {"_inner"}
    assert units["_inner"].deps == {"SCALE"}
    assert units["encode"].deps == {"js"}
    assert units["limit"].deps == {"LIMIT", "LIMIT #2"}
    assert units["everything"].deps == set(units) - {"everything"}  # globals()


def test_names_bound_by_imports_tuples_and_decorated_definitions():
    text = (
        "import a.b\nimport c.d as e\nfrom f import g, h as i\nX, (Y, *Z) = 1, (2, 3)\n"
        "N: int = 1\nN += 1\nobj.attr = 1\n\n@cache\n@other(1)\ndef j():\n    global Y\n"
        "    return 4\n"
    )
    units = nbtool.helpers_units(text)
    assert {u.key: u.names for u in units.values() if not u.always} == {
        "a": ("a",),
        "e": ("e",),
        "g": ("g", "i"),
        "X": ("X", "Y", "Z"),
        "N": ("N",),
        "N #2": ("N",),
        "j": ("j",),
    }
    assert [u.source for u in units.values() if u.always] == ["obj.attr = 1\n"]  # a side effect
    assert units["j"].source.startswith("@cache\n@other(1)\ndef j():")
    assert units["j"].deps == {"X"}  # Y, named by `global`, is X's unit


# ---------------------------------------------------------------------------- what is caught


def test_a_change_to_a_reached_function_is_caught():
    after = edited(HELPERS, "return _inner(x) + 1", "return _inner(x) + 2")
    assert stale(USES_REACHED, HELPERS, after)
    before = nbtool.helpers_reach(USES_REACHED, HELPERS)
    now = nbtool.helpers_reach(USES_REACHED, after)
    assert [k for k in before if before[k] != now[k]] == ["reached"]


def test_its_docstring_and_comments_are_not_caught_its_defaults_are():
    prose = edited(HELPERS, '"""Reached from the notebook."""',
                   '"""Reached, and edited:\n    now on two lines."""\n    # a comment')
    prose = edited(prose, "return _inner(x) + 1", "return _inner(x) + 1  # and one here")
    prose = edited(prose, "SCALE = 2", "SCALE = 2  # a constant's comment\n\n# a line of its own")
    assert nbtool.helpers_reach(USES_REACHED, prose) == nbtool.helpers_reach(USES_REACHED, HELPERS)
    assert stale(USES_REACHED, HELPERS, edited(HELPERS, "def reached(x):", "def reached(x=1):"))
    assert stale(USES_REACHED, HELPERS, edited(HELPERS, "def reached(x):", "def reached(y):"))


def test_a_change_to_an_unreached_function_is_not_caught():
    after = edited(HELPERS, "return x - 1", "return x - 2")
    assert not stale(USES_REACHED, HELPERS, after)
    assert stale(USES_UNREACHED, HELPERS, after)


def test_a_change_to_a_transitive_dependency_is_caught():
    after = edited(HELPERS, "return x * SCALE", "return x * SCALE * 1.0")
    assert stale(USES_REACHED, HELPERS, after)
    assert "_inner" in nbtool.helpers_reach(USES_REACHED, HELPERS)
    assert not stale(USES_UNREACHED, HELPERS, after)


def test_a_change_to_a_constant_a_reached_function_uses_is_caught():
    assert stale(USES_REACHED, HELPERS, edited(HELPERS, "SCALE = 2", "SCALE = 3"))
    assert not stale(USES_REACHED, HELPERS, edited(HELPERS, "UNUSED = 3", "UNUSED = 4"))


def test_a_new_import_a_reached_function_uses_is_caught():
    nb = notebook("import helpers\nhelpers.floored(2.5)")
    after = edited(HELPERS, "import os\n", "import math\nimport os\n")
    assert stale(nb, HELPERS, after)
    assert "math" in nbtool.helpers_reach(nb, after)
    assert not stale(USES_REACHED, HELPERS, after)
    swapped = edited(HELPERS, "import json as js", "import pickle as js")
    assert stale(notebook("helpers.encode(1)"), HELPERS, swapped)


def test_a_new_unrelated_function_above_a_reached_one_is_not_caught():
    new = "def brand_new(y):\n    return [y] * UNUSED\n\n\n"
    above = edited(HELPERS, "def _inner(x):", new + "def _inner(x):")
    at_top = edited(HELPERS, "from __future__", "BANNER = 'x'\n\n" + new + "from __future__")
    for after in (above, at_top):
        assert nbtool.helpers_reach(USES_REACHED, after) == nbtool.helpers_reach(
            USES_REACHED, HELPERS
        )


def test_moving_a_function_is_not_caught_but_reordering_statements_is():
    limit = "def limit():\n    return LIMIT\n\n\n"
    moved = edited(edited(HELPERS, limit, ""), "def reached(x):", limit + "def reached(x):")
    nb = notebook("helpers.reached(1), helpers.limit()")
    assert not stale(nb, HELPERS, moved)
    swapped = edited(HELPERS, "LIMIT = 1\nLIMIT = 2", "LIMIT = 2\nLIMIT = 1")
    assert stale(nb, HELPERS, swapped)  # helpers.LIMIT is 1 now
    assert not stale(USES_UNREACHED, HELPERS, swapped)
    # SCALE = 2 after the `if` that may set it: every unit's text is the same, not their order
    after = edited(HELPERS, "SCALE = 2\n", "")
    after = edited(after, "\n\ndef _inner", "SCALE = 2\n\n\ndef _inner")
    before, now = nbtool.helpers_reach(nb, HELPERS), nbtool.helpers_reach(nb, after)
    assert [k for k in before if before[k] != now[k]] == [nbtool.ORDER_KEY]


def test_a_change_to_a_statement_that_always_runs_is_caught_for_every_notebook():
    after = edited(HELPERS, "SCALE = 5", "SCALE = 6")
    for nb in (USES_REACHED, USES_UNREACHED, USES_NOTHING):
        assert stale(nb, HELPERS, after)
    future = edited(HELPERS, "from __future__ import annotations\n", "")
    assert stale(USES_NOTHING, HELPERS, future)


def test_a_function_that_reads_globals_reaches_every_unit():
    reach = nbtool.helpers_reach(notebook("helpers.everything()"), HELPERS)
    assert set(reach) - {nbtool.ORDER_KEY} == set(nbtool.helpers_units(HELPERS))


def test_names_not_defined_in_helpers_are_ignored():
    nb = notebook("helpers.reached(1)\nhelpers.no_such_name\nopen('helpers.py')")
    assert nbtool.helpers_reach(nb, HELPERS) == nbtool.helpers_reach(USES_REACHED, HELPERS)
    assert "math" not in nbtool.helpers_reach(notebook("helpers.floored(1)"), HELPERS)


# ---------------------------------------------------------------------------- a notebook's roots


@pytest.mark.parametrize(
    "source, roots",
    [
        ("import helpers as h\n\nh.reached(1)\nprint(h.SCALE)", {"reached", "SCALE"}),
        ("from helpers import reached, unreached as u  # two", {"reached", "unreached"}),
        ("from helpers import (\n    reached,  # one\n    encode as e,\n)\ne(1)",
         {"reached", "encode"}),
        ("from helpers import reached, \\\n    limit", {"reached", "limit"}),
        ("%matplotlib inline\n!nvidia-smi\nhelpers.reached(1)", {"reached"}),
        ("importlib.reload(helpers)\nhelpers.reached(1)", {"reached"}),
        # a worker script the notebook writes to a file: its helpers count too
        ('SCRIPT = """\nimport helpers\nhelpers.unreached(2)\n"""', {"unreached"}),
    ],
)
def test_roots_from_attributes_aliases_and_from_imports(source, roots):
    assert nbtool.notebook_helpers_roots(notebook("import helpers", source)) == roots


def test_a_name_only_in_a_string_literal_counts():
    script = "open('w.py', 'w').write('import helpers; helpers.unreached(1)')"
    nb = notebook("import helpers", script)
    assert "unreached" in nbtool.helpers_reach(nb, HELPERS)
    assert stale(nb, HELPERS, edited(HELPERS, "return x - 1", "return x - 2"))


@pytest.mark.parametrize(
    "source",
    [
        "from helpers import *",
        "fn = getattr(helpers, name)",
        "print(vars(helpers))",
        "table = helpers.__dict__",
        "names = dir(helpers)",
        "import helpers as h\nfn = getattr(h, 'reached')",
        "h = helpers\nh.unreached(1)",
        "run_with(helpers)",
        "module = sys.modules['helpers']",
        'module = importlib.import_module("helpers")',
    ],
)
def test_hiding_which_names_are_used_reaches_the_whole_module(source):
    nb = notebook("import helpers", "helpers.reached(1)", source)
    assert nbtool.notebook_helpers_roots(nb) is None
    reach = nbtool.helpers_reach(nb, HELPERS)
    assert set(reach) - {nbtool.ORDER_KEY} == set(nbtool.helpers_units(HELPERS))
    assert stale(nb, HELPERS, edited(HELPERS, "return x - 1", "return x - 2"))


# ---------------------------------------------------------------------------- what is hashed

CODE = 'def f(x=1):\n    """What f does."""\n    # why it does it\n    return x  # because\n'


@pytest.mark.parametrize("same", [
    'def f(x=1):\n    """Another docstring,\n    on two lines."""\n    return x\n',
    "def f(x=1):\n\n    return x   # edited\n\n\n# a comment of its own\n",
    "def f(x=1):\r\n    return x\r\n",
])
def test_comments_docstrings_and_blank_lines_are_not_hashed(same):
    assert nbtool.runnable_text(same) == nbtool.runnable_text(CODE)


@pytest.mark.parametrize("before, after", [
    (CODE, CODE.replace("x=1", "x=2")),  # a default
    (CODE, CODE.replace("return x", "return -x")),
    ("if a:\n    b()\nc()\n", "if a:\n    b()\n    c()\n"),  # an indentation
    ('print("a  # not a comment")', 'print("a  # edited")'),  # a string that prints
    ('s = """a\n\nb"""', 's = """a\nb"""'),  # a blank line inside a string
    ('s = """a  \nb"""', 's = """a\nb"""'),  # trailing spaces inside a string
    ("x = f'{1}  # in an f-string'", "x = f'{1}  # edited'"),
    ('"shown"', '"other"'),  # a cell's own leading string is its output, not a docstring
    ("print(1)", "# NBVAL_CHECK_OUTPUT\nprint(1)"),  # nbval's markers decide what is compared
    ("%time x = 1  # a magic", "%time x = 1  # is not Python: hashed as written"),
])
def test_code_strings_defaults_and_nbval_markers_are_hashed(before, after):
    assert nbtool.runnable_text(before) != nbtool.runnable_text(after)


def test_a_comment_in_a_code_cell_leaves_the_code_hash():
    nb = notebook("import helpers\n", "x = helpers.reached(1)  # why\nprint(x)")
    commented = notebook("import helpers  # the module\n",
                         "# first\nx = helpers.reached(1)\nprint(x)")
    assert nbtool.code_sha256(commented) == nbtool.code_sha256(nb)
    assert nbtool.run_version(commented, HELPERS) == nbtool.run_version(nb, HELPERS)
    assert nbtool.code_sha256(notebook("import helpers\n", "x = helpers.reached(2)\nprint(x)")) \
        != nbtool.code_sha256(nb)


def test_a_helpers_name_only_in_a_comment_is_not_reached():
    nb = notebook("import helpers\n", "helpers.reached(1)  # unlike helpers.unreached")
    assert "unreached" not in nbtool.helpers_reach(nb, HELPERS)


HASHING_SCRIPT = """\
import ast, glob, hashlib, io, json, sys, tokenize
source = open("tools/nbtool.py").read()
wanted = {"_docstrings", "_column", "_one_newline", "_parsed", "runnable_text",
          "NBVAL_MARKER"}
namespace = {"ast": ast, "io": io, "tokenize": tokenize}
for node in ast.parse(source).body:
    names = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
    if getattr(node, "name", None) in wanted or set(names) & wanted:
        exec(ast.get_source_segment(source, node), namespace)
texts = [namespace["runnable_text"]("".join(c["source"]))
         for path in sorted(glob.glob("notebooks/*.ipynb"))
         for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
texts.append(namespace["runnable_text"](open("helpers.py").read()))
print(hashlib.sha256(json.dumps(texts).encode()).hexdigest())
"""


def _pythons() -> dict[str, str]:
    """Python 3.11 and newer on this machine, by version (the GPU host stamps with 3.12)."""
    found = {}
    for candidate in [sys.executable, *glob.glob(os.path.expanduser(
            "~/.pyenv/versions/3.1[1-9]*/bin/python3")), "/usr/bin/python3"]:
        done = subprocess.run([candidate, "-c", "import sys; print(sys.version_info >= (3, 11),"
                               " sys.version.split()[0])"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.startswith("True"):
            found.setdefault(done.stdout.split()[1].rsplit(".", 1)[0], candidate)
    return found


def test_the_hashed_text_is_the_same_under_every_python_here():
    pythons = _pythons()
    if len(pythons) < 2:
        pytest.skip(f"one Python 3.11+ here ({', '.join(pythons)}): nothing to compare with")
    digests = {version: subprocess.run([python, "-c", HASHING_SCRIPT], cwd=nbtool.ROOT,
                                       capture_output=True, text=True, check=True).stdout
               for version, python in pythons.items()}
    assert len(set(digests.values())) == 1, digests


# ---------------------------------------------------------------------------- the stamp


def stamped(nb, text: str, hashed=nbtool.runnable_text):
    nb = copy.deepcopy(nb)
    stamp = {
        "gpu": "NVIDIA Test GPU",
        "code_sha256": nbtool.code_sha256(nb, hashed),
        "helpers_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "helpers_units": nbtool.helpers_reach(nb, text, hashed),
    }
    if hashed is nbtool.runnable_text:
        stamp["hash_scheme"] = nbtool.HASH_SCHEME
    nb.metadata[nbtool.METADATA_KEY] = {"provenance": stamp}
    return nb


@pytest.fixture
def helpers_here(tmp_path, monkeypatch):
    """A repository root of our own, whose helpers.py the test writes."""
    monkeypatch.setattr(nbtool, "ROOT", tmp_path)

    def write(text: str) -> None:
        (tmp_path / "helpers.py").write_text(text, encoding="utf-8", newline="")

    return write


def test_provenance_reports_only_changes_where_the_notebook_reaches(helpers_here):
    nb = stamped(USES_REACHED, HELPERS)
    helpers_here(HELPERS)
    assert nbtool.provenance_problems(nb, "00_x.ipynb") == []
    helpers_here(edited(HELPERS, "return x - 1", "return x - 2"))  # the file's hash changes
    assert nbtool.provenance_problems(nb, "00_x.ipynb") == []
    helpers_here(edited(HELPERS, "SCALE = 2", "SCALE = 3\nNEW = 1"))
    problems = nbtool.provenance_problems(nb, "00_x.ipynb")
    assert len(problems) == 1
    assert problems[0].startswith("00_x.ipynb: helpers.py changed where it reaches (SCALE) ")
    assert "python tools/nbtool.py run notebooks/00_x.ipynb" in problems[0]
    nb.cells.append(nbformat.v4.new_code_cell("helpers.limit()"))
    problem = nbtool.provenance_problems(nb, "00_x.ipynb")[-1]
    assert "LIMIT is new" in problem and "limit is new" in problem


def test_a_stamp_over_the_text_as_written_asks_to_be_migrated(helpers_here):
    helpers_here(HELPERS)
    nb = stamped(USES_REACHED, HELPERS, nbtool.as_written)
    assert nbtool.provenance_problems(nb, "00_x.ipynb") == [
        "00_x.ipynb: its stamp hashes the code as written, comments included: python "
        "tools/nbtool.py migrate-hashes notebooks/00_x.ipynb, or re-run it on a GPU: "
        "python tools/nbtool.py run notebooks/00_x.ipynb"]


def test_execute_stamps_the_hashes_of_the_code(tmp_path, monkeypatch):
    import nbclient

    class NoKernel:  # execute()'s stamp without a kernel: nothing runs, outputs stay empty
        def __init__(self, nb, **_):
            pass

        def execute(self):
            pass

    monkeypatch.setattr(nbclient, "NotebookClient", NoKernel)
    path = tmp_path / "00_demo.ipynb"
    nb = notebook("helpers.environment_report()", "helpers.format_bytes(1)")
    nbtool.fix(nb, path, nbtool.settings())
    nbtool.write(nb, path)
    stamp = nbtool.execute(path)
    assert stamp["hash_scheme"] == nbtool.HASH_SCHEME
    assert stamp["code_sha256"] == nbtool.code_sha256(nbtool.read(path))
    assert stamp["helpers_units"] == nbtool.helpers_reach(nbtool.read(path))
    assert {"format_bytes", "environment_report", "colab_setup"} <= set(stamp["helpers_units"])
    assert stamp["helpers_sha256"] == nbtool.helpers_sha256()


# ---------------------------------------------------------------------------- checkup.py

CHECKUP = '''\
"""A small check-up module beside helpers.py."""

from helpers import reached, unreached

RATIO = 2


def check(x):
    """Reached from the notebook."""
    return reached(x) * RATIO


def other(x):
    return unreached(x)
'''

USES_CHECKUP = notebook("import helpers\nimport checkup\n", "checkup.check(1)")


@pytest.fixture
def modules_here(tmp_path, monkeypatch):
    """A repository root of our own, whose helpers.py and checkup.py the test writes."""
    monkeypatch.setattr(nbtool, "ROOT", tmp_path)

    def write(helpers: str, checkup: str) -> None:
        (tmp_path / "helpers.py").write_text(helpers, encoding="utf-8", newline="")
        (tmp_path / "checkup.py").write_text(checkup, encoding="utf-8", newline="")

    return write


def checkup_stamped(nb, helpers: str, checkup: str):
    nb = stamped(nb, helpers)
    stamp = nb.metadata[nbtool.METADATA_KEY]["provenance"]
    stamp["helpers_units"] = nbtool.helpers_reach(nb, helpers, siblings={"checkup": checkup})
    stamp.update(nbtool.sibling_stamps(nb, {"checkup": checkup}))
    return nb


def test_a_notebook_reaches_the_checkup_units_it_names_and_what_they_use_of_helpers():
    reach = nbtool.sibling_reach(USES_CHECKUP, "checkup", CHECKUP)
    assert {"check", "RATIO", "reached"} <= set(reach) and "other" not in reach
    # check() calls helpers.reached: that is the notebook's reach of helpers.py too
    helpers = nbtool.helpers_reach(USES_CHECKUP, HELPERS, siblings={"checkup": CHECKUP})
    assert {"reached", "_inner", "SCALE"} <= set(helpers)
    # a notebook that does not import checkup has no checkup units, and keeps its stamp's keys
    assert nbtool.sibling_reach(USES_REACHED, "checkup", CHECKUP) == {}
    assert nbtool.sibling_stamps(USES_REACHED, {"checkup": CHECKUP}) == {}
    assert set(nbtool.sibling_stamps(USES_CHECKUP, {"checkup": CHECKUP})) == {"checkup_units"}


def test_a_change_to_checkup_py_makes_only_the_notebooks_that_reach_it_stale(modules_here):
    nb, plain = checkup_stamped(USES_CHECKUP, HELPERS, CHECKUP), stamped(USES_REACHED, HELPERS)
    modules_here(HELPERS, CHECKUP)
    assert nbtool.provenance_problems(nb, "09_x.ipynb") == []
    modules_here(HELPERS, edited(CHECKUP, "return unreached(x)", "return unreached(x) + 1"))
    assert nbtool.provenance_problems(nb, "09_x.ipynb") == []  # other() is not reached
    modules_here(HELPERS, edited(CHECKUP, "RATIO = 2", "RATIO = 3"))
    problems = nbtool.provenance_problems(nb, "09_x.ipynb")
    assert problems == [problems[0]] and problems[0].startswith(
        "09_x.ipynb: checkup.py changed where it reaches (RATIO) ")
    assert nbtool.provenance_problems(plain, "00_x.ipynb") == []
    # a change to helpers.py that only checkup.py reaches makes the notebook stale too
    modules_here(edited(HELPERS, "return x * SCALE", "return x * SCALE * 1"), CHECKUP)
    problems = nbtool.provenance_problems(nb, "09_x.ipynb")
    assert len(problems) == 1 and "helpers.py changed where it reaches (_inner)" in problems[0]
    # the margin runs' version follows checkup.py as the stamp does
    modules_here(HELPERS, CHECKUP)
    version = nbtool.run_version(nb, HELPERS)
    modules_here(HELPERS, edited(CHECKUP, "RATIO = 2", "RATIO = 3"))
    assert nbtool.run_version(nb, HELPERS) != version


def test_reach_of_a_checkup_unit_names_the_notebooks_that_import_it(modules_here, tmp_path,
                                                                     monkeypatch):
    modules_here(HELPERS, CHECKUP)
    monkeypatch.setattr(nbtool, "NOTEBOOKS", tmp_path)
    nbtool.write(USES_CHECKUP, tmp_path / "09_x.ipynb")
    nbtool.write(USES_REACHED, tmp_path / "00_x.ipynb")
    assert [p.name for p, *_ in nbtool.unit_reach("RATIO")] == ["09_x.ipynb"]
    assert [p.name for p, *_ in nbtool.unit_reach("_inner")] == ["00_x.ipynb", "09_x.ipynb"]
    with pytest.raises(ValueError, match="no top-level 'nothing'"):
        nbtool.unit_reach("nothing")


# ---------------------------------------------------------------------------- prose in outputs


@pytest.mark.parametrize("source", [
    "print(helpers.reached.__doc__)",
    "help(helpers.reached)",
    "import inspect\nprint(inspect.getdoc(helpers.reached))",
    "import inspect\nprint(inspect.getsource(helpers.reached))",
    "import inspect\n\n\ndef mine():\n    pass\n\n\nprint(inspect.getsource(mine))",
    "helpers.reached?",
])
def test_a_notebook_that_prints_a_docstring_or_its_source_fails(helpers_here, source):
    helpers_here(HELPERS)
    nb = stamped(notebook("import helpers", source), HELPERS)
    problems = nbtool.provenance_problems(nb, "00_x.ipynb")
    assert len(problems) == 1 and "00_x.ipynb, cell 1: reads " in problems[0], problems


def test_reading_a_library_s_source_is_allowed(helpers_here):
    helpers_here(HELPERS)  # as 06 prints the lines of torch's DataLoader it discusses
    source = "import inspect\nimport torch.utils.data as module\nprint(inspect.getsource(module))"
    assert nbtool.provenance_problems(stamped(notebook(source), HELPERS), "00_x.ipynb") == []


def test_a_reached_helper_that_reads_its_docstring_fails(helpers_here):
    text = edited(HELPERS, "return _inner(x) + 1", "return reached.__doc__")
    helpers_here(text)
    problems = nbtool.provenance_problems(stamped(USES_REACHED, text), "00_x.ipynb")
    assert problems == ["00_x.ipynb: helpers.py's reached reads __doc__, which the hashes leave "
                        "out"]
    assert nbtool.provenance_problems(stamped(USES_UNREACHED, text), "00_x.ipynb") == []


def test_an_output_that_quotes_a_source_line_fails(helpers_here):
    helpers_here(HELPERS)
    nb = stamped(USES_REACHED, HELPERS)
    nb.cells[1].outputs = [nbformat.v4.new_output(
        "stream", name="stderr", text="/repo/helpers.py:12: UserWarning: careful\n")]
    problems = nbtool.provenance_problems(nb, "00_x.ipynb")
    assert len(problems) == 1 and "quotes a source line (helpers.py:12)" in problems[0]


# ---------------------------------------------------------------------------- migrate-hashes


@pytest.fixture
def as_written(tmp_path, monkeypatch):
    """A notebook stamped over its text as written, with margin runs of that version and one
    of an older version, in a repository root of our own."""
    monkeypatch.setattr(nbtool, "ROOT", tmp_path)
    monkeypatch.setattr(nbtool, "MARGINS", tmp_path / "margins.json")
    (tmp_path / "helpers.py").write_text(HELPERS, encoding="utf-8", newline="")
    nb = stamped(notebook("import helpers  # the module\n", "helpers.reached(1)"), HELPERS,
                 nbtool.as_written)
    path = tmp_path / "00_demo.ipynb"
    nbtool.write(nb, path)
    old = nbtool.run_version(nb, HELPERS, nbtool.as_written)
    runs = [{"run": f"r{i}", "notebook": path.name, "version": v, "claims": []}
            for i, v in enumerate([old, old, "an-older-one"])]
    nbtool.write_margins(runs)
    return path


def test_migrate_hashes_rewrites_the_stamp_and_its_margin_runs(as_written):
    before = json.loads(as_written.read_text())
    assert nbtool.main(["migrate-hashes", str(as_written)]) == 0
    after = json.loads(as_written.read_text())
    stamp, old = after["metadata"]["collection"]["provenance"], \
        before["metadata"]["collection"]["provenance"]
    assert {k for k in stamp if stamp[k] != old.get(k)} == {
        "code_sha256", "helpers_units", "hash_scheme"}
    after["metadata"]["collection"]["provenance"] = old
    assert after == before  # cells, outputs and every other field as they were
    nb = nbtool.read(as_written)
    assert nbtool.provenance_problems(nb, as_written.name) == []
    versions = [r["version"] for r in nbtool.read_margins()]
    assert versions == [nbtool.run_version(nb)] * 2 + ["an-older-one"]
    runs = nbtool.current_runs(as_written, nb, nbtool.read_margins())
    assert [r["run"] for r in runs] == ["committed-None", "r0", "r1"]
    again = as_written.read_bytes()
    assert nbtool.main(["migrate-hashes", str(as_written)]) == 0
    assert as_written.read_bytes() == again


@pytest.mark.parametrize("change", ["comment in a cell", "helpers.py where it reaches"])
def test_migrate_hashes_refuses_a_notebook_stale_by_its_text(as_written, change, capsys):
    if change == "comment in a cell":  # free from now on, but not yet: its text is not what ran
        nb = nbtool.read(as_written)
        nb.cells[0].source = "import helpers  # the module, edited\n"
        nbtool.write(nb, as_written)
        wanted = "its code cells are not the text its outputs were made with"
    else:
        (nbtool.ROOT / "helpers.py").write_text(edited(HELPERS, "SCALE = 2", "SCALE = 3"))
        wanted = "helpers.py changed where it reaches (SCALE)"
    before, margins = as_written.read_bytes(), nbtool.MARGINS.read_bytes()
    assert nbtool.main(["migrate-hashes", str(as_written)]) == 1
    assert as_written.read_bytes() == before and nbtool.MARGINS.read_bytes() == margins
    err = capsys.readouterr().err
    assert f"00_demo.ipynb: refused: {wanted}" in err and "1 notebook(s) refused" in err
    assert nbtool.provenance_problems(nbtool.read(as_written), as_written.name)  # still stale


# ---------------------------------------------------------------------------- the collection


@pytest.fixture(params=nbtool.notebook_paths(), ids=lambda p: p.name)
def committed(request):
    return request.param, nbtool.read(request.param)


def test_every_notebook_reaches_environment_report(committed):
    path, nb = committed
    reach = nbtool.helpers_reach(nb)
    assert reach and "environment_report" in reach, path.name


def test_migrating_a_committed_notebook_from_its_text_hash_gives_its_stamp(committed, tmp_path):
    path, nb = committed
    stamp = nb.metadata[nbtool.METADATA_KEY]["provenance"]
    stamp["code_sha256"] = nbtool.code_sha256(nb, nbtool.as_written)  # as the old rule stamped
    stamp["helpers_units"] = nbtool.helpers_reach(nb, hashed=nbtool.as_written)
    del stamp["hash_scheme"]
    copied = tmp_path / path.name
    nbtool.write(nb, copied)
    print(nbtool.migrate_hashes(copied, []))
    assert copied.read_bytes() == path.read_bytes()


# ---------------------------------------------------------------------------- an edit's price

REACHED_WIDELY = "format_bytes"  # a unit of helpers.py that most notebooks reach
SIGNATURE = "def format_bytes(nbytes: float) -> str:\n"


def git(repo, *args: str) -> str:
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    command += ["-c", "commit.gpgsign=false", *args]
    return subprocess.run(command, cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def collection(tmp_path, monkeypatch):
    """A git repository holding a copy of helpers.py, checkup.py and the notebooks, as committed
    here; nbtool works in it."""
    shutil.copy(nbtool.ROOT / "helpers.py", tmp_path / "helpers.py")
    shutil.copy(nbtool.ROOT / "checkup.py", tmp_path / "checkup.py")
    shutil.copytree(nbtool.NOTEBOOKS, tmp_path / "notebooks")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "as committed")
    monkeypatch.setattr(nbtool, "ROOT", tmp_path)
    monkeypatch.setattr(nbtool, "NOTEBOOKS", tmp_path / "notebooks")
    return tmp_path


def _listed(out: str) -> list[str]:
    return re.findall(r"^  (\d\d_\w+\.ipynb) ", out, re.M)


def test_prose_edits_leave_every_notebook_current_and_a_number_does_not(collection, capsys):
    paths = nbtool.notebook_paths()
    runs = nbtool.read_margins(MARGINS)
    text = (collection / "helpers.py").read_text(encoding="utf-8")
    assert SIGNATURE in text, "pick another unit for this test"
    reaching = [p.name for p in paths if REACHED_WIDELY in nbtool.helpers_reach(nbtool.read(p))]
    assert len(reaching) >= 10
    current = {p.name: len(nbtool.current_runs(p, nbtool.read(p), runs)) for p in paths}
    # a docstring and a comment in the unit, a comment in a code cell of a notebook
    prose = edited(text, SIGNATURE, SIGNATURE + '    """Bytes in the largest binary unit that '
                   'fits."""\n    # three significant figures keep a column narrow\n')
    (collection / "helpers.py").write_text(prose, encoding="utf-8", newline="")
    first = paths[0]
    nb = nbtool.read(first)
    cell = next(c for c in nb.cells if c.cell_type == "code" and not nbtool.is_setup_cell(c)
                and re.search(r"^\s*# (?!NBVAL_)", c.source, re.M))
    cell.source = re.sub(r"^(\s*# )(?!NBVAL_)", r"\1(a comment, edited) ", cell.source,
                         count=1, flags=re.M)
    nbtool.write(nb, first)
    for path in paths:
        nb = nbtool.read(path)
        assert nbtool.provenance_problems(nb, path.name) == [], path.name
        assert len(nbtool.current_runs(path, nb, runs)) == current[path.name], path.name
    assert nbtool.main(["reach"]) == 0
    assert "make no notebook stale" in capsys.readouterr().out
    # one number of that unit
    number = edited(prose, '("KiB", 2**10)', '("KiB", 2**11)')
    (collection / "helpers.py").write_text(number, encoding="utf-8", newline="")
    stale = [p.name for p in paths if nbtool.provenance_problems(nbtool.read(p), p.name)]
    assert stale == reaching
    for path in paths:
        made = len(nbtool.current_runs(path, nbtool.read(path), runs))
        assert made == (1 if path.name in reaching else current[path.name]), path.name
    assert nbtool.main(["reach"]) == 0
    out = capsys.readouterr().out
    assert _listed(out) == reaching and f"make {len(reaching)} notebook(s) stale" in out
    assert nbtool.main(["reach", "--unit", REACHED_WIDELY]) == 0
    assert _listed(capsys.readouterr().out) == reaching


def test_reach_prices_each_notebook_at_its_wall_time_times_the_runs_it_needs():
    nb = notebook("helpers.reached(1)")
    nb.metadata[nbtool.METADATA_KEY] = {"provenance": {"wall_seconds": 20.0}}
    two = copy.deepcopy(nb)
    two.metadata[nbtool.METADATA_KEY]["requires_gpus"] = 2
    table = nbtool.price_table([(Path("00_a.ipynb"), nb, "code cells"),
                                (Path("10_b.ipynb"), two, "helpers.py (x)")])
    runs = 2 * nbtool.MARGIN_RUNS
    assert f"00_a.ipynb                       20.0 s x  {runs} =   {20 * runs:3d} s  code cells" \
        in table
    assert "10_b.ipynb                       20.0 s x  1 =    20 s  helpers.py (x) (a 2-GPU " \
        "machine)" in table
    assert f"{runs + 1} runs =   {20 * runs + 20:3d} s" in table


def test_reach_names_no_such_unit(capsys):
    assert nbtool.main(["reach", "--unit", "format_byte"]) == 1
    assert ("helpers.py and checkup.py have no top-level 'format_byte' (did you mean "
            "format_bytes") in \
        capsys.readouterr().err


@pytest.mark.parametrize("name", ["09_training_step.ipynb", "13_host_bound_steps.ipynb"])
def test_a_notebook_reaches_only_the_helpers_its_checkup_code_uses(name):
    # A quoted "helpers" in checkup.py once made it reach all of helpers.py, so that a change to
    # the checkpoint loader made 09 and 13 stale
    nb = nbformat.read(nbtool.NOTEBOOKS / name, as_version=4)
    through = nbtool._sibling_helpers_roots(nb, None)
    assert through is not None and "format_bytes" in through
    assert "_merged" not in nbtool.helpers_reach(nb)
