"""What of helpers.py a notebook reaches (tools/nbtool.py): the provenance stamp's
``helpers_units``, the staleness it reports, and the ``restamp`` migration.

A notebook is stale when code of helpers.py that it can reach changed, and only then: these
tests edit a small helpers module in every way that can matter (or must not) and check which
notebooks the edit makes stale.
"""

import copy
import hashlib
import json
import subprocess

import nbformat
import pytest

from tools import nbtool

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
    after = edited(HELPERS, '"""Reached from the notebook."""', '"""Reached, and edited."""')
    assert stale(USES_REACHED, HELPERS, after)
    before = nbtool.helpers_reach(USES_REACHED, HELPERS)
    now = nbtool.helpers_reach(USES_REACHED, after)
    assert [k for k in before if before[k] != now[k]] == ["reached"]


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


# ---------------------------------------------------------------------------- the stamp


def stamped(nb, text: str, with_units: bool = True):
    nb = copy.deepcopy(nb)
    stamp = {
        "gpu": "NVIDIA Test GPU",
        "code_sha256": nbtool.code_sha256(nb),
        "helpers_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    if with_units:
        stamp["helpers_units"] = nbtool.helpers_reach(nb, text)
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


def test_a_stamp_without_helpers_units_compares_the_whole_file(helpers_here):
    nb = stamped(USES_REACHED, HELPERS, with_units=False)
    helpers_here(HELPERS)
    assert nbtool.provenance_problems(nb, "00_x.ipynb") == []
    helpers_here(edited(HELPERS, "return x - 1", "return x - 2"))
    assert nbtool.provenance_problems(nb, "00_x.ipynb") == [
        "00_x.ipynb: helpers.py changed since its outputs were made; re-run it on a GPU: "
        "python tools/nbtool.py run notebooks/00_x.ipynb"
    ]


def test_execute_stamps_helpers_units(tmp_path, monkeypatch):
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
    assert stamp["helpers_units"] == nbtool.helpers_reach(nbtool.read(path))
    assert {"format_bytes", "environment_report", "colab_setup"} <= set(stamp["helpers_units"])
    assert stamp["helpers_sha256"] == nbtool.helpers_sha256()


# ---------------------------------------------------------------------------- restamp


def git(repo, *args: str) -> str:
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    command += ["-c", "commit.gpgsign=false", *args]
    return subprocess.run(command, cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository whose notebook ran with HELPERS (commit 1); helpers.py then changed
    where the notebook reaches (commit 2)."""
    git(tmp_path, "init", "-q")
    (tmp_path / "helpers.py").write_text(HELPERS, encoding="utf-8", newline="")
    nb = stamped(USES_REACHED, HELPERS, with_units=False)
    nb.cells[1].outputs = [nbformat.v4.new_output(
        "execute_result", {"text/plain": "3"}, execution_count=1
    )]
    nb.cells[1].execution_count = 1
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "notebooks" / "00_demo.ipynb"
    nbtool.write(nb, path)
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "run")
    (tmp_path / "helpers.py").write_text(edited(HELPERS, "SCALE = 2", "SCALE = 3"), newline="")
    git(tmp_path, "commit", "-q", "-am", "helpers changed")
    monkeypatch.setattr(nbtool, "ROOT", tmp_path)
    return path


def test_restamp_refuses_a_helpers_py_that_did_not_make_the_outputs(repo, capsys):
    before = repo.read_bytes()
    assert nbtool.main(["restamp", "--helpers-from", "HEAD", str(repo)]) == 1
    assert repo.read_bytes() == before
    assert "00_demo.ipynb: refused: helpers.py at HEAD" in capsys.readouterr().err
    assert nbtool.main(["restamp", "--helpers-from", "no-such-rev", str(repo)]) == 1
    assert repo.read_bytes() == before


def test_restamp_writes_only_helpers_units_from_the_helpers_py_that_made_the_outputs(repo):
    before = json.loads(repo.read_text())
    assert nbtool.main(["restamp", "--helpers-from", "HEAD~1", str(repo)]) == 0
    after = json.loads(repo.read_text())
    units = after["metadata"]["collection"]["provenance"].pop("helpers_units")
    assert after == before  # cells, outputs and every other field as they were
    nb = nbtool.read(repo)
    assert units == nbtool.helpers_reach(nb, HELPERS)  # over the old text, not the current one
    assert units != nbtool.helpers_reach(nb)
    problems = nbtool.provenance_problems(nb, repo.name)
    assert len(problems) == 1 and "helpers.py changed where it reaches (SCALE)" in problems[0]
    again = repo.read_bytes()
    assert nbtool.main(["restamp", "--helpers-from", "HEAD~1", str(repo)]) == 0
    assert repo.read_bytes() == again


def test_restamp_refuses_a_notebook_whose_code_changed_since_it_ran(repo, capsys):
    nb = nbtool.read(repo)
    nb.cells[1].source += "\nhelpers.unreached(1)"
    nbtool.write(nb, repo)
    before = repo.read_bytes()
    assert nbtool.main(["restamp", "--helpers-from", "HEAD~1", str(repo)]) == 1
    assert repo.read_bytes() == before
    assert "its code cells changed" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the collection


@pytest.fixture(params=nbtool.notebook_paths(), ids=lambda p: p.name)
def committed(request):
    return request.param, nbtool.read(request.param)


def test_every_notebook_reaches_environment_report(committed):
    path, nb = committed
    reach = nbtool.helpers_reach(nb)
    assert reach and "environment_report" in reach, path.name


def test_restamping_a_committed_notebook_changes_only_its_stamp(committed, tmp_path):
    path, nb = committed
    text = (nbtool.ROOT / "helpers.py").read_bytes()
    stamp = nb.metadata[nbtool.METADATA_KEY]["provenance"]
    stamp["helpers_sha256"] = hashlib.sha256(text).hexdigest()  # as if it ran with this file
    stamp["code_sha256"] = nbtool.code_sha256(nb)  # and with these cells
    stamp.pop("helpers_units", None)
    copied = tmp_path / path.name
    nbtool.write(nb, copied)
    print(nbtool.restamp(copied, text, "HEAD"))
    stamp["helpers_units"] = nbtool.helpers_reach(nb, text.decode())
    nbtool.write(nb, tmp_path / "expected.ipynb")
    assert copied.read_bytes() == (tmp_path / "expected.ipynb").read_bytes()
    assert nbtool.format_problems(path, nbtool.read(copied), nbtool.settings()) == []
