"""Static checks of every committed notebook (CPU tier: no kernel, no GPU).

The committed outputs must come from one clean top-to-bottom GPU run of exactly the committed
code; these tests catch a notebook edited without re-running, a hand-edited output, a broken
format and claims that the recorded measurements do not support.
"""

import copy
import re
import shutil
import subprocess
import sys
import time

import nbformat
import pytest

from tools import nbtool

ROOT = nbtool.ROOT
NOTEBOOKS = nbtool.notebook_paths()
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img[^>]+src=\"([^\"]+)\"")


def test_the_collection_has_notebooks():
    assert NOTEBOOKS, "no notebooks found in notebooks/"


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.name)
def notebook(request):
    return request.param, nbtool.read(request.param)


def test_valid_nbformat(notebook):
    path, nb = notebook
    nbformat.validate(nb)


def test_canonical_format(notebook):
    path, nb = notebook
    assert nbtool.format_problems(path, nb, nbtool.settings()) == []


def saved_as_jupyterlab_saves(path, destination):
    """Write ``path`` as JupyterLab 4 saves it after opening it: the running kernel's spec and
    language_info (this Python's version) in the metadata, ``collapsed`` set on each code cell
    whose outputs are hidden (JupyterLab mirrors ``jupyter.outputs_hidden`` into it), and the
    JSON from JavaScript's JSON.stringify, which has no float type, so that 20.0 is written 20,
    as the server's nbformat writes it (keys sorted, indent 1). tests/test_jupyterlab.py checks
    it against a real JupyterLab's save, byte for byte."""
    import json

    def javascript_numbers(value):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, dict):
            return {k: javascript_numbers(v) for k, v in value.items()}
        if isinstance(value, list):
            return [javascript_numbers(v) for v in value]
        return value

    saved = javascript_numbers(json.loads(path.read_text(encoding="utf-8")))
    for cell in saved["cells"]:
        if cell["cell_type"] == "code" and cell["metadata"].get("jupyter", {}).get(
                "outputs_hidden"):
            cell["metadata"]["collapsed"] = True
    saved["metadata"]["kernelspec"] = {"display_name": "Python 3 (ipykernel)",
                                       "language": "python", "name": "python3"}
    saved["metadata"]["language_info"] = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
        "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
        "pygments_lexer": "ipython3", "version": sys.version.split()[0]}
    destination.write_text(json.dumps(saved, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                           encoding="utf-8")
    return destination


def test_a_notebook_jupyterlab_saved_passes_the_checks(notebook, tmp_path):
    # A teacher opens a notebook in JupyterLab, autosave rewrites it, then the tests run.
    path, nb = notebook
    saved = nbtool.read(saved_as_jupyterlab_saves(path, tmp_path / path.name))
    assert saved.metadata.kernelspec.display_name == "Python 3 (ipykernel)"  # ipykernel's
    assert nbtool.format_problems(path, saved, nbtool.settings()) == []
    assert nbtool.provenance_problems(saved, path.name) == []
    assert nbtool.headline_texts(saved) == nbtool.headline_texts(nb)
    conf = nbtool.settings()
    assert nbtool.readme_table([tmp_path / path.name], conf) == nbtool.readme_table([path], conf)


def test_the_format_check_still_wants_the_python3_kernel(notebook):
    path, nb = notebook
    other = copy.deepcopy(nb)
    other.metadata.kernelspec = {"display_name": "R", "language": "R", "name": "ir"}
    assert any("kernelspec" in p for p in nbtool.format_problems(path, other, nbtool.settings()))


def test_outputs_come_from_one_clean_top_to_bottom_run(notebook):
    path, nb = notebook
    counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name}: execution counts {counts} are not 1..{len(counts)}; "
        f"run it with: python tools/nbtool.py run notebooks/{path.name}")


def test_no_error_outputs_unless_expected(notebook):
    path, nb = notebook
    for index, cell in enumerate(nb.cells):
        if "raises-exception" in cell.metadata.get("tags", []):
            continue
        for output in cell.get("outputs", []):
            assert output.output_type != "error", (
                f"{path.name}, cell {index}: {output.ename}: {output.evalue}")


def test_provenance_matches_the_code(notebook):
    path, nb = notebook
    assert nbtool.provenance_problems(nb, path.name) == []
    stamp = nb.metadata[nbtool.METADATA_KEY]["provenance"]
    assert stamp["gpu"], f"{path.name} was not executed on a GPU"
    for key in ("torch", "cuda", "date", "wall_seconds"):
        assert stamp.get(key), f"{path.name}: provenance lacks {key}"


#: What a workshop can afford per notebook (seconds on the GPU it ran on; MiB of host memory
#: for the kernel and its DataLoader workers together), unless the notebook's metadata says
#: otherwise (``collection.budget``).
BUDGET = {"wall_seconds": 90, "process_tree_peak_mib": 6144}


def test_the_committed_run_kept_to_its_budget(notebook):
    path, nb = notebook
    info = nb.metadata[nbtool.METADATA_KEY]
    stamp, budget = info["provenance"], {**BUDGET, **info.get("budget", {})}
    for key, limit in budget.items():
        if stamp.get(key) is not None:  # runs before the stamp had the field cannot say
            assert stamp[key] <= limit, f"{path.name}: {key} = {stamp[key]} > {limit}"


def test_a_changed_code_cell_is_caught(notebook):
    path, nb = notebook
    edited = copy.deepcopy(nb)
    cell = next(c for c in edited.cells if c.cell_type == "code" and not nbtool.is_setup_cell(c))
    cell.source += "\nprint('edited')"
    problems = nbtool.provenance_problems(edited, path.name)
    assert problems and path.name in problems[0] and "nbtool.py run" in problems[0]


def test_recorded_measurements_support_the_claims(notebook):
    path, nb = notebook
    measured = {m["key"]: m for m in nbtool.outputs_metadata(nb, "measurement")}
    claims = nbtool.outputs_metadata(nb, "claim")
    assert claims, f"{path.name} states no claim"
    assert any(m["headline"] for m in measured.values()), f"{path.name} has no headline result"
    import helpers

    for claim in claims:
        if not claim.get("applies", True):  # helpers.claim_where, on a host it does not fit
            assert claim["reason"], f"{path.name}: '{claim['statement']}' untested, no reason"
            continue
        for side in ("lhs", "rhs"):
            if isinstance(claim[side], str):
                assert claim[side] in measured, f"{path.name}: {claim[side]} was never recorded"
        assert helpers.evaluate_claim(claim, measured), (
            f"{path.name}: the recorded numbers contradict '{claim['statement']}'")


def _image_links(text: str) -> list[str]:
    return [a or b for a, b in IMAGE_LINK.findall(text)]


def test_referenced_figures_exist():
    sources = [(ROOT / "README.md", (ROOT / "README.md").read_text())]
    for path in NOTEBOOKS:
        nb = nbtool.read(path)
        sources += [(path, c.source) for c in nb.cells if c.cell_type == "markdown"]
    missing = [f"{doc.name}: {link}" for doc, text in sources for link in _image_links(text)
               if not link.startswith("http") and not (doc.parent / link).exists()]
    assert missing == []


def test_figures_are_named_after_their_notebook():
    numbers = {p.name[:2] for p in NOTEBOOKS}
    strays = [p.name for p in (ROOT / "figures").glob("*.png")
              if not re.match(r"\d\d_", p.name) or p.name[:2] not in numbers]
    assert strays == []


def test_the_one_page_sheet_is_current_linked_and_drawn():
    sheet = (ROOT / "SHEET.md").read_text(encoding="utf-8")
    assert sheet == nbtool.sheet_markdown(NOTEBOOKS), "SHEET.md is stale: nbtool.py check --fix"
    rules = [r["rule"] for p in NOTEBOOKS
             for r in nbtool.read(p).metadata[nbtool.METADATA_KEY].get("rules", [])]
    assert rules and all(f"- [ ] {rule} ([" in sheet for rule in rules)
    assert "](SHEET.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    drawing = (ROOT / nbtool.SHEET_FIGURE).read_text(encoding="utf-8")
    for step in ("pageable", "pinned", "copy engines", "device memory", "side stream",
                 "compute stream"):
        assert step in drawing, step
    assert "<title" in drawing and "<desc" in drawing  # read aloud by a screen reader


def test_the_readme_keeps_the_answers_folded():
    # The headline results and the measurements behind the rules answer the predictions: a
    # reader who wants to predict meets them only inside a <details> fold.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = re.sub(r"<details>.*?</details>", "", readme, flags=re.S)
    answers = [text for p in NOTEBOOKS for text in nbtool.headline_texts(nbtool.read(p))]
    assert answers and all(text in readme for text in answers)
    assert [text for text in answers if text in shown] == []
    assert readme.count("<summary>") >= 2


def test_readme_generated_sections_are_current():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert nbtool.current_readme(readme, NOTEBOOKS, nbtool.settings()) == readme, (
        "README.md's notebook table or teaching section is stale: "
        "python tools/nbtool.py check --fix")


def test_a_stale_rule_of_thumb_is_caught(notebook):
    path, nb = notebook
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rule = nb.metadata["collection"]["rules"][0]["rule"]
    assert rule in readme
    edited = readme.replace(rule, rule + " (edited by hand)")
    assert nbtool.current_readme(edited, NOTEBOOKS, nbtool.settings()) == readme


def test_every_notebook_ends_with_a_checked_hidden_solution(notebook):
    path, nb = notebook
    solutions = [c for c in nb.cells if nbtool.is_solution_cell(c)]
    assert solutions and all(c.metadata["jupyter"]["source_hidden"] for c in solutions)
    ran = [o for c in solutions for o in c.get("outputs", [])
           if o.get("metadata", {}).get("collection", {}).get("claim")]
    assert ran, f"{path.name}: the committed run shows no claim checked by the solution"


def test_the_format_checker_catches_a_missing_or_visible_solution(notebook):
    path, nb = notebook
    conf = nbtool.settings()
    visible = copy.deepcopy(nb)
    cell = next(c for c in visible.cells if nbtool.is_solution_cell(c))
    cell.metadata["jupyter"]["source_hidden"] = False
    cell.source = cell.source.replace("helpers.claim(", "print(")
    problems = nbtool.format_problems(path, visible, conf)
    assert any("hidden" in p for p in problems) and any("helpers.claim" in p for p in problems)
    missing = copy.deepcopy(nb)
    for c in missing.cells:
        c.metadata.get("tags", []).clear() if nbtool.is_solution_cell(c) else None
    assert any("tagged 'solution'" in p for p in nbtool.format_problems(path, missing, conf))
    nbtool.fix(visible, path, conf)
    assert not any("hidden" in p for p in nbtool.format_problems(path, visible, conf))


def test_the_exercise_belongs_to_the_core_path(notebook):
    path, nb = notebook
    conf = nbtool.settings()
    assert not any("core path, before" in p for p in nbtool.format_problems(path, nb, conf))
    late = copy.deepcopy(nb)  # a "Going further" heading put before the exercise
    first = next(i for i, c in enumerate(late.cells) if c.cell_type == "markdown" and i > 0)
    late.cells.insert(first, nbformat.v4.new_markdown_cell(nbtool.GOING_FURTHER))
    assert any("core path, before" in p for p in nbtool.format_problems(path, late, conf))


def test_a_rule_must_cite_a_recorded_measurement(notebook):
    path, nb = notebook
    if not nbtool.outputs_metadata(nb, "measurement"):
        pytest.skip(f"{path.name} has not been run yet")
    edited = copy.deepcopy(nb)
    edited.metadata["collection"]["rules"][0]["evidence"] = "never_recorded"
    assert any("never_recorded" in p
               for p in nbtool.format_problems(path, edited, nbtool.settings()))


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "helpers.py",
                             "checkup.py", "conftest.py", "tests", "tools", "notebooks"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npytest\n" in readme and re.search(r"^\s*(python -m )?pytest\s*$", ci, re.M)


CHECKED = "# NBVAL_CHECK_OUTPUT"
#: Notebooks whose checked cells still branch on the host (cores, copy engines, a link rate):
#: nbval then compares another text on another host. A notebook leaves this list when its
#: claims move to helpers.claim_where (issue 19) at its next GPU run; none joins it (12 was
#: executed before claim_where existed).
STILL_BRANCHING: frozenset = frozenset()


def branches(source: str) -> list[str]:
    """The branches in a cell's code: if, a conditional expression, match, try, while, and a
    comprehension's if."""
    import ast

    kinds = (ast.If, ast.IfExp, ast.Match, ast.Try, ast.While)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, kinds) or (isinstance(node, ast.comprehension) and node.ifs):
            found.append(f"line {getattr(node, 'lineno', '?')}: {type(node).__name__}")
    return found


def test_checked_cells_do_not_branch(notebook):
    # A checked cell prints the same text on every host: a claim that holds only on some hosts
    # goes through helpers.claim_where(..., applies=..., reason=...), not under an if.
    path, nb = notebook
    if path.name in STILL_BRANCHING:
        pytest.skip(f"{path.name} still branches in a checked cell (STILL_BRANCHING)")
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and CHECKED in cell.source.splitlines():
            assert branches(cell.source) == [], f"{path.name}, cell {index} branches"


def test_the_branch_check_catches_a_branch():
    assert branches("if cores >= 4:\n    helpers.claim('a', 'b', '<', 1)\n")
    assert branches("helpers.claim('a', 'b', '<', 1 if fast else 2)\n")
    assert branches("x = [c for c in cs if c]\n")
    assert branches("try:\n    x = 1\nexcept ValueError:\n    x = 2\n")
    assert branches("helpers.claim_where('a', 'b', '<', 1, applies=cores >= 4 and fast,\n"
                    "                    reason='r')\nx = [c for c in cs]\n") == []


def test_sanitize_file_is_ascii():
    # nbval reads it with the platform's default encoding
    assert (ROOT / "tests" / "sanitize.cfg").read_text(encoding="utf-8").isascii()


def _sized_notebook(core_words, core_code, further=True, long_cell=0):
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    setup = code("import helpers\n" * 50)  # boilerplate: never counted
    setup.metadata["tags"] = [nbtool.SETUP_TAG]
    solution = code("x = 1\n" * 60)  # hidden: never counted
    solution.metadata["tags"] = [nbtool.SOLUTION_TAG]
    chunks = [min(20, core_code - k) for k in range(0, core_code, 20)]  # cells of 20 lines
    cells = [md("# Title"), setup, md("word " * core_words)]
    cells += [code("# a comment\n\n" + "y = 2\n" * n) for n in chunks] + [solution]
    if long_cell:
        cells.append(code("z = 3\n" * long_cell))
    if further:
        cells += [md(nbtool.GOING_FURTHER + "\n\nmore words here"), code("w = 4\n" * 7)]
    return nbformat.v4.new_notebook(cells=cells)


def test_core_path_sizes_count_prose_and_code_before_going_further():
    sizes = nbtool.core_sizes(_sized_notebook(100, 12))
    assert sizes["split"] and sizes["core"] == (101, 12)  # "# Title": one word
    assert sizes["whole"] == (101 + 5, 12 + 7) and sizes["longest"][0] == 13
    assert nbtool.core_sizes(_sized_notebook(100, 12, further=False))["split"] is False


def test_the_format_checker_holds_every_notebook_to_the_core_targets():
    within = _sized_notebook(nbtool.CORE_WORDS - 10, nbtool.CORE_CODE_LINES - 10)
    assert nbtool.core_problems("x.ipynb", within) == []
    words = nbtool.core_problems("x.ipynb", _sized_notebook(nbtool.CORE_WORDS + 1, 5))
    lines = nbtool.core_problems("x.ipynb", _sized_notebook(5, nbtool.CORE_CODE_LINES + 1))
    cell = nbtool.core_problems("x.ipynb", _sized_notebook(5, 5, long_cell=nbtool.CELL_LINES + 1))
    assert ["prose words" in p for p in words] == [True]
    assert ["code lines" in p for p in lines] == [True]
    assert any("lines in one code cell" in p for p in cell)
    # not split, and over the targets: it must be split, unless it is listed as not yet split
    unsplit = _sized_notebook(5000, 900, further=False)
    assert any("split it" in p for p in nbtool.core_problems("x.ipynb", unsplit))
    assert nbtool.core_problems("x.ipynb", unsplit, frozenset({"x.ipynb"})) == []
    # the list only shrinks: a listed notebook that is short enough, or split, must leave it
    short = _sized_notebook(5, 5, further=False)
    assert nbtool.core_problems("x.ipynb", short) == []
    assert any("NOT_YET_SPLIT" in p
               for p in nbtool.core_problems("x.ipynb", short, frozenset({"x.ipynb"})))
    assert any("NOT_YET_SPLIT" in p
               for p in nbtool.core_problems("x.ipynb", within, frozenset({"x.ipynb"})))


def test_a_script_written_to_a_file_is_not_a_long_cell():
    script = 'SCRIPT = r"""\n' + "print(1)\n" * 80 + '"""\nopen("s.py", "w").write(SCRIPT)\n'
    assert nbtool._cell_lines(script) == 1  # the line that writes it
    assert nbtool._cell_lines("%%writefile s.py\n" + "print(1)\n" * 80) == 0
    assert nbtool._cell_lines("a = 1\n\nb = 2\n# why\n") == 3


def test_the_syllabus_gives_reading_time_for_the_core_and_the_whole():
    section = nbtool.teaching_section(NOTEBOOKS, nbtool.settings())
    assert "reading, core / whole" in section
    assert "of reading on the core paths" in section


COSTS = {"00": 20, "01": 20, "02": 30, "03": 25, "04": 10}
BUILDS_ON = {"01": ["00"], "02": ["01"], "03": ["01", "02"], "04": ["00"]}


def test_prerequisites_are_counted_by_their_fewest_steps():
    assert nbtool.prerequisites("03", BUILDS_ON) == {"01": 1, "02": 1, "00": 2}
    assert nbtool.prerequisites("00", BUILDS_ON) == {}


def test_an_agenda_reaches_its_notebook_and_takes_what_it_builds_on_whole_where_it_fits():
    fixed = nbtool.SETUP_MINUTES + nbtool.BREAK_MINUTES
    brief = nbtool.BRIEF_MINUTES
    # 03 whole and the rest in brief is the least; then the closest first (01, 02), then 00
    least = fixed + 25 + 3 * brief
    assert nbtool.agenda(least, "03", COSTS, BUILDS_ON) == [
        ("00", "in brief"), ("01", "in brief"), ("02", "in brief"), ("03", "core path")]
    assert nbtool.agenda(least + 20 - brief, "03", COSTS, BUILDS_ON) == [
        ("00", "in brief"), ("01", "core path"), ("02", "in brief"), ("03", "core path")]
    assert nbtool.agenda(fixed + 95, "03", COSTS, BUILDS_ON)[0] == ("00", "core path")
    with pytest.raises(ValueError, match="cannot reach 03"):
        nbtool.agenda(least - 1, "03", COSTS, BUILDS_ON)


def test_a_schedule_starts_with_the_set_up_and_breaks_near_the_middle():
    slots = nbtool.schedule([("00", "in brief"), ("01", "core path"), ("02", "core path")],
                            COSTS)
    assert slots == [("set-up", nbtool.SETUP_MINUTES), ("00 (in brief)", nbtool.BRIEF_MINUTES),
                     ("01 (core path)", 20), ("break", nbtool.BREAK_MINUTES),
                     ("02 (core path)", 30)]


def test_every_agenda_sets_up_breaks_and_reaches_its_notebook_in_its_minutes():
    conf = nbtool.settings()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    builds_on = {p.name[:2]: nbtool.read(p).metadata[nbtool.METADATA_KEY].get("builds_on", [])
                 for p in NOTEBOOKS}
    assert conf["agendas"]["3 hours"]["reaches"] == "09"  # the check-up, with 07 on its way
    for name, budget in conf["agendas"].items():
        line = next(line for line in readme.splitlines() if line.startswith(f"- **{name}**"))
        assert line.startswith(f"- **{name}**, reaching {budget['reaches']}: 0:00 set-up · ")
        assert line.count(" break · ") == 1, line
        taken = re.findall(r"\d:\d\d (\d\d) \((core path|in brief)\)", line)
        wanted = set(nbtool.prerequisites(budget["reaches"], builds_on)) | {budget["reaches"]}
        assert {n for n, _ in taken} == wanted, line
        assert (budget["reaches"], "core path") in taken, line
        total, minutes = map(int, re.search(r"end \((\d+) of (\d+) minutes", line).groups())
        assert total <= minutes == budget["minutes"], line
    three_hours = next(line for line in readme.splitlines() if line.startswith("- **3 hours**"))
    assert "07 (core path)" in three_hours and "09 (core path)" in three_hours


def _run_in_a_kernel(sources: list[str], folder) -> list:
    """Run code cells in a fresh kernel in ``folder`` as Run all does (it stops at an error);
    each cell's outputs."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3",
                       resources={"metadata": {"path": str(folder)}}).execute()
    except CellExecutionError:
        pass
    return [cell.outputs for cell in nb.cells]


ON_COLAB = "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')"


def _one_line_failure(outputs: list) -> str:
    errors = [o for o in outputs if o.output_type == "error"]
    assert len(errors) == 1 and len(errors[0].traceback) == 1, errors
    assert not [o for o in outputs if o.get("name") == "stderr"], outputs  # no warning either
    return errors[0].traceback[0]


#: the set-up cells: every notebook's, and 09 and 13's, which fetch checkup.py too
SETUP_MODULES = [(), ("checkup.py",)]


@pytest.mark.parametrize("modules", SETUP_MODULES)
def test_the_set_up_cell_says_in_one_line_where_the_collection_is_not_published(tmp_path,
                                                                                 modules):
    # On Colab a notebook downloads helpers.py from the address in [tool.collection]; where
    # nothing is published there (a fork, a rename), the reader gets one line, not a traceback
    # and IPython's "To exit: use 'exit'" warning.
    conf = nbtool.settings()
    not_found = ("import urllib.error, urllib.request\n"
                 "def not_found(url, *args, **kwargs):\n"
                 "    raise urllib.error.HTTPError(url, 404, 'Not Found', None, None)\n"
                 "urllib.request.urlopen = not_found")
    outputs = _run_in_a_kernel([ON_COLAB, not_found, nbtool.setup_source(conf, modules)],
                               tmp_path)
    message = _one_line_failure(outputs[2])
    assert message.startswith("Set-up failed: cannot download helpers.py from https://")
    assert conf["repository"] in message and "404" in message
    assert "[tool.collection]" in message


@pytest.mark.parametrize("modules", SETUP_MODULES)
def test_the_set_up_cell_gives_up_on_a_download_that_stalls(tmp_path, modules):
    import socket

    with socket.socket() as server:  # accepts the connection, then never answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        source = nbtool.setup_source(nbtool.settings(), modules)
        timeout = f"timeout={nbtool.SETUP_TIMEOUT_S})"
        assert source.count(timeout) == 1 and source.count("https://raw.githubusercontent.com/")
        source = source.replace(timeout, "timeout=2)").replace(
            "https://raw.githubusercontent.com/", f"http://127.0.0.1:{port}/")
        start = time.perf_counter()
        outputs = _run_in_a_kernel([ON_COLAB, source], tmp_path)
        waited = time.perf_counter() - start
    message = _one_line_failure(outputs[1])
    assert "timed out" in message and message.startswith("Set-up failed: cannot download")
    assert waited < 60, waited


@pytest.mark.parametrize("modules", SETUP_MODULES)
def test_the_set_up_cell_says_in_one_line_that_helpers_py_is_missing(tmp_path, modules):
    outputs = _run_in_a_kernel([nbtool.setup_source(nbtool.settings(), modules)], tmp_path)
    assert _one_line_failure(outputs[0]).startswith("Set-up failed: no helpers.py in this folder")


def test_the_set_up_cell_of_a_notebook_with_the_check_up_says_that_checkup_py_is_missing(
        tmp_path):
    shutil.copyfile(ROOT / "helpers.py", tmp_path / "helpers.py")
    outputs = _run_in_a_kernel([nbtool.setup_source(nbtool.settings(), ("checkup.py",))],
                               tmp_path)
    assert _one_line_failure(outputs[0]).startswith("Set-up failed: no checkup.py in this folder")


def test_only_the_notebooks_that_import_the_check_up_fetch_it():
    # 09 and 13 import checkup.py: their set-up cells fetch it with helpers.py; every other
    # set-up cell is the one canonical cell, byte for byte
    conf = nbtool.settings()
    fetching = set()
    for path in nbtool.notebook_paths():
        nb = nbtool.read(path)
        modules = nbtool.setup_modules(nb)
        assert nb.cells[1].source == nbtool.setup_source(conf, modules)
        if modules:
            assert modules == ("checkup.py",) and '"checkup.py"' in nb.cells[1].source
            fetching.add(path.name[:2])
    assert fetching == {"09", "13"}
    plain = nbtool.notebook_paths()[0]
    nb = nbtool.read(plain)
    nb.cells.append(nbformat.v4.new_code_cell("import checkup"))
    problems = nbtool.format_problems(plain, nb, conf)
    assert any("canonical set-up cell" in p for p in problems), problems


def test_a_blank_copy_runs_outside_colab(tmp_path):
    # `nbtool.py blank OUT` writes the copies readers predict with; outside Colab they find
    # the helpers.py written beside them and run (here up to the cells that need CUDA).
    written = nbtool.write_blank_copies(tmp_path)
    for module in ("helpers.py", "checkup.py"):  # 09 and 13 import checkup.py too
        assert (tmp_path / module).read_bytes() == (ROOT / module).read_bytes()

    def without_cuda(path) -> list[str]:  # the code cells before the first that needs CUDA
        cells = []
        for cell in nbtool.read(path).cells:
            if cell.cell_type == "code":
                if nbtool.CPU_OK_TAG not in cell.metadata.get("tags", []):
                    break
                cells.append(cell.source)
        return cells

    path = max(written, key=lambda p: len(without_cuda(p)))
    cells = without_cuda(path)
    cells.append("import os\nprint(os.path.realpath(helpers.__file__))")
    outputs = _run_in_a_kernel(cells, path.parent)
    assert not [o for out in outputs for o in out if o.output_type == "error"], outputs
    assert outputs[-1][0].text.strip() == str(tmp_path / "helpers.py")


def test_a_folded_cell_shows_only_its_label(notebook):
    # JupyterLab shows a folded cell's first line in its place: an answer there is given away.
    path, nb = notebook
    folded = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
              and nbtool.is_folded(c)]
    assert folded, f"{path.name}: no folded answer"
    assert nbtool.fold_label_problems(path.name, nb) == []
    told = copy.deepcopy(nb)
    cell = told.cells[folded[0]]
    cell.source = cell.source.replace("\n\n", " ", 1)  # the answer back on the label's line
    problems = nbtool.fold_label_problems(path.name, told)
    assert problems == [f"{path.name}, cell {folded[0]}: a folded cell's first line shows: it "
                        f"should be only one of {', '.join(nbtool.FOLD_LABELS)} (check --fix "
                        "moves the rest below it)"]
    nbtool.fix(told, path, nbtool.settings())
    assert told.cells[folded[0]].source == nb.cells[folded[0]].source


def test_the_answer_after_a_solution_is_folded_in_jupyterlab_too(notebook):
    path, nb = notebook
    if not nbtool.answer_cells(nb):
        pytest.skip(f"{path.name}: no answer in words after its solution")
    shown = copy.deepcopy(nb)
    shown.cells[nbtool.answer_cells(nb)[0]].metadata["jupyter"]["source_hidden"] = False
    assert any("the answer after a solution is hidden" in p
               for p in nbtool.solution_problems(path.name, shown))
    outputs = copy.deepcopy(nb)
    solution = next(c for c in outputs.cells if nbtool.is_solution_cell(c))
    solution.metadata["jupyter"].pop("outputs_hidden")
    assert any("outputs are hidden too" in p for p in nbtool.solution_problems(path.name, outputs))


def _figure_cell(names: list[str], texts: dict) -> nbformat.NotebookNode:
    """A code cell that saves and shows one figure per name, a text line before each."""
    source = "\n".join(f'helpers.save_figure(fig, "{name}")' for name in names)
    outputs = []
    for name in names:
        outputs.append(nbformat.v4.new_output("display_data", {"text/plain": f"before {name}"}))
        outputs.append(nbformat.v4.new_output("display_data", {"image/png": "iVBOR",
                                                                 "text/plain": "<Figure>"}))
    cell = nbformat.v4.new_code_cell(source, outputs=outputs)
    cell.metadata[nbtool.METADATA_KEY] = {nbtool.FIGURE_TEXTS: texts}
    return cell


ALT = {"alt": "Bar chart of four clocks timing one copy.",
       "caption": "Only the synchronized clocks see the copy."}


def test_every_figure_needs_alt_text_and_a_caption_in_words():
    nb = nbformat.v4.new_notebook(cells=[_figure_cell(["00_a", "00_b"], {"00_a": ALT})])
    problems = nbtool.figure_problems("00_x.ipynb", nb)
    assert any("'00_b' needs its alt" in p for p in problems), problems
    assert any("'00_b' needs its caption" in p for p in problems), problems
    nb.cells[0].metadata[nbtool.METADATA_KEY][nbtool.FIGURE_TEXTS]["00_b"] = {
        "alt": "the figure ../_images/0123.png drawn", "caption": ALT["caption"]}
    assert any("not a file name" in p for p in nbtool.figure_problems("00_x.ipynb", nb))
    nb.cells[0].metadata[nbtool.METADATA_KEY][nbtool.FIGURE_TEXTS]["00_b"] = ALT
    assert nbtool.figure_problems("00_x.ipynb", nb) == []
    nb.cells[0].outputs.pop()  # one figure shown, two saved
    assert any("1 figure(s) shown, 2 saved" in p for p in nbtool.figure_problems("00_x", nb))


def test_the_site_shows_each_figure_alone_with_its_caption_and_the_rest_in_order():
    cell = _figure_cell(["00_a", "00_b"], {"00_a": ALT, "00_b": ALT})
    parts = nbtool.figure_cells(cell)
    assert [p.source == cell.source for p in parts] == [True, False, False, False]
    assert all(nbtool.REMOVE_INPUT_TAG in p.metadata.get("tags", []) for p in parts[1:])
    assert [o for p in parts for o in p.outputs] == cell.outputs  # nothing lost or reordered
    captioned = [p for p in parts if "mystnb" in p.metadata]
    assert [p.metadata["mystnb"]["figure"]["name"] for p in captioned] == ["fig-00_a", "fig-00_b"]
    assert all(len(p.outputs) == 1 and "image/png" in p.outputs[0]["data"] for p in captioned)


def test_the_site_joins_a_cells_record_lines_into_one_block():
    lines = [nbformat.v4.new_output("display_data", {"text/plain": f"line {i}"}) for i in range(3)]
    figure = nbformat.v4.new_output("display_data", {"image/png": "iVBOR", "text/plain": "F"})
    merged = nbtool.merged_text_displays([*lines, figure, lines[0]])
    assert [o["data"]["text/plain"] for o in merged] == ["line 0\nline 1\nline 2", "F", "line 0"]
    assert lines[0]["data"]["text/plain"] == "line 0"  # the notebook's outputs stay as they are


def test_the_site_shows_the_set_up_cell_without_its_output(notebook):
    path, nb = notebook
    staged = nbtool.site_notebook(nb, path.name, nbtool.settings())
    setup = next(c for c in staged.cells if nbtool.is_setup_cell(c))
    assert nbtool.REMOVE_OUTPUT_TAG in setup.metadata["tags"]
    assert nbtool.REMOVE_OUTPUT_TAG not in next(
        c for c in nb.cells if nbtool.is_setup_cell(c)).metadata["tags"]


def test_a_bare_issue_reference_is_caught_and_linked_once():
    text = ("it raises (pytorch/pytorch#85796, NVIDIA/apex #304); see "
            "[pytorch/pytorch#1](https://x.org/1).")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])
    assert len(nbtool.issue_link_problems("00_x.ipynb", nb)) == 2
    linked = nbtool.linked_issues(text)
    assert "[pytorch/pytorch#85796](https://github.com/pytorch/pytorch/issues/85796)" in linked
    assert "[NVIDIA/apex#304](https://github.com/NVIDIA/apex/issues/304)" in linked
    assert nbtool.linked_issues(linked) == linked
    nb.cells[0].source = linked
    assert nbtool.issue_link_problems("00_x.ipynb", nb) == []


def test_the_run_it_yourself_copy_has_the_same_cells_and_no_outputs(notebook, tmp_path):
    """Colab's badge opens this copy (the Pages workflow writes it to the run branch): a reader
    who predicts before running meets no answer first, and runs exactly the committed code."""
    path, nb = notebook
    copy_path = tmp_path / path.name
    nbtool.write(nbtool.blank_notebook(nb), copy_path)
    blank = nbtool.read(copy_path)
    assert [(c.cell_type, c.source) for c in blank.cells if c.cell_type == "code"] == [
        (c.cell_type, c.source) for c in nb.cells if c.cell_type == "code"]
    assert len(blank.cells) == len(nb.cells)
    folded = set(nbtool.answer_cells(nb)) | {
        i for i, c in enumerate(nb.cells) if nbtool.is_short_answer(c)}
    assert folded  # every notebook has a short answer under its question
    for i, (cell, committed) in enumerate(zip(blank.cells, nb.cells, strict=True)):
        if i in folded:  # behind a click in Colab too, which ignores the folding metadata
            assert cell.source.startswith('<details class="answer">\n<summary>')
            assert committed.source in cell.source and cell.source.endswith("</details>")
        else:
            assert cell.source == committed.source
    code = [c for c in blank.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert any(c.outputs for c in nb.cells if c.cell_type == "code")  # the committed run is kept
    conf = nbtool.settings()
    header = nb.cells[0].source
    assert f"]({nbtool.run_url(path.name, conf)})" in header
    assert f"]({nbtool.colab_url(path.name, conf)})" in header
    assert conf["run_branch"] in nbtool.run_url(path.name, conf)


def test_the_blank_command_writes_every_notebook(tmp_path):
    assert nbtool.main(["blank", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "notebooks").iterdir()) == [p.name for p in NOTEBOOKS]


def _teaching_notebook(*cells) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=list(cells))


PROMPT = nbformat.v4.new_markdown_cell("**Predict before you run.** How much faster?")
GUESS = nbformat.v4.new_code_cell('my_guess = None  # how many times faster\n'
                                  'helpers.expect_guess(my_guess, "my_guess")')
SHORT = nbformat.v4.new_markdown_cell("**Short answer.** Several times.",
                                      metadata={"jupyter": {"source_hidden": True}})
RECORD = nbformat.v4.new_code_cell('helpers.record("speedup", 3.0, "x", "faster by")')
ANSWER = nbformat.v4.new_code_cell('helpers.answer("speedup", my_guess)')


def test_a_prediction_needs_its_folded_short_answer_and_in_a_typed_notebook_its_guess():
    typed = frozenset({"t.ipynb"})
    complete = _teaching_notebook(PROMPT, GUESS, SHORT, RECORD, ANSWER)
    assert nbtool.prediction_problems("t.ipynb", complete, typed) == []
    no_short = _teaching_notebook(PROMPT, GUESS, RECORD, ANSWER)
    assert any("short answer" in p for p in nbtool.prediction_problems(
        "t.ipynb", no_short, typed))
    shown = copy.deepcopy(complete)
    shown.cells[2].metadata["jupyter"]["source_hidden"] = False
    assert any("is folded" in p for p in nbtool.prediction_problems(
        "t.ipynb", shown, typed))
    untyped = _teaching_notebook(PROMPT, SHORT, RECORD)
    assert any("typed" in p for p in nbtool.prediction_problems(
        "t.ipynb", untyped, typed))
    assert nbtool.prediction_problems("u.ipynb", untyped, typed) == []
    unanswered = _teaching_notebook(PROMPT, GUESS, SHORT, RECORD)
    assert any("never shown beside its result" in p for p in nbtool.prediction_problems(
        "t.ipynb", unanswered, typed))
    unstopped = _teaching_notebook(PROMPT, nbformat.v4.new_code_cell("my_guess = None"), SHORT,
                                   RECORD, ANSWER)
    assert any("Run all stops" in p for p in nbtool.prediction_problems(
        "t.ipynb", unstopped, typed))


def test_run_all_in_a_blank_copy_stops_at_the_first_prediction_with_one_line(tmp_path,
                                                                            monkeypatch):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nbtool.write_blank_copies(tmp_path)
    path = tmp_path / "notebooks" / "00_timing_async_work.ipynb"
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("COLLECTION_GUESSES", "")  # a reader's kernel: nobody set it
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    with pytest.raises(CellExecutionError):
        client.execute()  # Run all: it stops at the first cell that raises
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    stopped = ran[-1]
    assert nbtool.GUESS.search(stopped.source), stopped.source  # at the first prediction
    errors = [o for o in stopped.outputs if o.output_type == "error"]
    assert errors and errors[0].ename == "GuessNeeded"
    assert len(errors[0].traceback) == 1 and "type your guess into my_guess" in \
        errors[0].traceback[0]


def test_the_record_and_the_checks_are_folded_and_kept_apart_from_the_lesson():
    loop = nbformat.v4.new_code_cell('for k in ("a", "b"):\n    helpers.record(k, 1.0, "", k)')
    checks = nbformat.v4.new_code_cell('# NBVAL_CHECK_OUTPUT\nhelpers.claim("s", "a", ">", 0)')
    mixed = nbformat.v4.new_code_cell('t = time_it()\nhelpers.record("t", t, "ms", "t")')
    iffed = nbformat.v4.new_code_cell('if known:\n    helpers.record("a", 1.0, "", "a")')
    assert nbtool.is_bookkeeping_cell(loop) and nbtool.is_bookkeeping_cell(checks)
    assert nbtool.is_bookkeeping_cell(iffed)
    assert not nbtool.is_bookkeeping_cell(mixed)
    nb = _teaching_notebook(copy.deepcopy(loop), copy.deepcopy(checks), copy.deepcopy(mixed))
    problems = nbtool.bookkeeping_problems("t.ipynb", nb, frozenset({"t.ipynb"}))
    assert sum("are folded" in p for p in problems) == 2
    assert any("cell 2: split" in p for p in problems)
    assert not any("split" in p for p in nbtool.bookkeeping_problems("u.ipynb", nb, frozenset()))
    nbtool.fix(nb, nbtool.NOTEBOOKS / "t.ipynb", nbtool.settings())  # folds them
    folded = [c for c in nb.cells if nbtool.is_bookkeeping_cell(c)]
    assert folded and all(nbtool.is_folded(c) for c in folded)
    counted = [c for _, c in nbtool._counted_cells(nb)]
    assert not any(nbtool.is_bookkeeping_cell(c) for c in counted)  # not read, not counted
