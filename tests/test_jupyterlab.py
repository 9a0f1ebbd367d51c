"""A notebook opened in JupyterLab stays as committed (issue 49), checked in the real thing.

A reader clones the collection, starts JupyterLab and opens a notebook. Its kernel starts, and
JupyterLab writes the kernel's spec and ``language_info`` into the notebook's metadata. Where
that changes anything (``language_info.version`` is the reader's Python, and the notebooks were
executed on one Python only), the document is modified, and autosave writes it back within its
interval (120 s by default) as JavaScript serialized it (20.0 becomes 20): the reader's next
``git pull`` refuses. ``python tools/nbtool.py lab`` starts JupyterLab with tools/lab.py's
pre-save hook, which saves a notebook that was only opened as the file already was.

Here JupyterLab servers run on a copy of the collection (the committed bytes), with their own
config, data, runtime, settings and workspace folders (nothing of the user's is read) and an
autosave interval of AUTOSAVE_S seconds (JupyterLab's overrides.json): one started by that
command exactly, and, for contrast, a plain ``jupyter lab``. Headless Chromium, driven by
Playwright, opens each notebook as a double-click in the file browser does; its kernel starts.
The tests wait for real signals: the kernel idle with the kernel's metadata written into the
document, then a save completed, or HOLD_S (several autosave intervals) with the document
unmodified. Then they shut the kernel down, close the notebook and compare the file's bytes.

- On `lab`, every notebook keeps its bytes, on any Python: where the kernel's differs from the
  notebook's, JupyterLab does save it, and the hook (its line in the server's log) keeps them.
- On a plain ``jupyter lab``, a reader on another Python than the notebooks' gets a notebook
  rewritten, as tests/test_notebooks.py's ``saved_as_jupyterlab_saves`` simulates, byte for
  byte: the hook is what keeps the bytes.
- An edit made in `lab` (a new cell) is saved: the hook hides no edit.
- The hook itself, without a server: equal content reserialized keeps the file's bytes; an
  edited source, output, cell or metadata saves as sent.

One browser serves the whole module, one page for each server (each notebook opens and closes
in it, as a reader opening one after another); the module takes about a minute on 2 cores.
The servers' tests need Debian's ``chromium``, the ``playwright`` package and JupyterLab, as
tests/test_site.py does; without them, they skip.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from test_notebooks import saved_as_jupyterlab_saves
from test_site import CHROMIUM, CHROMIUM_ARGS

from tools import lab as lab_hook
from tools import nbtool

AUTOSAVE_S = 1  # JupyterLab's autosave interval here (its default: 120 s)
HOLD_S = 3 * AUTOSAVE_S + 2  # unmodified this long after the kernel's metadata came: no save
TIMEOUT_MS = 120_000  # for each wait: the server, the page, the kernel, a save
#: the Python the kernels run (the server's, which starts ``python`` kernels with its own), as
#: ipykernel reports it in language_info
KERNEL_PYTHON = sys.version.split()[0]
SETTINGS = {
    "@jupyterlab/docmanager-extension:plugin": {"autosave": True, "autosaveInterval": AUTOSAVE_S},
    # no request to the Jupyter news feed or for updates (nothing outside is reachable)
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
}
NBTOOL = Path(nbtool.__file__)
OTHER_PYTHON = "other-python"  # the folder of the copies for a reader on another Python
EDITED = "edited"  # the folder of the copy a reader edits
EDIT = "A note of the reader's."  # the markdown cell the reader adds


# ---------------------------------------------------------------------------- the hook alone


def server_writes(content: dict) -> bytes:
    """The bytes Jupyter Server's FileContentsManager writes for a notebook model's content."""
    return (nbformat.writes(nbformat.from_dict(content), version=nbformat.NO_CONVERT)
            + "\n").encode("utf-8")


def sent_by_jupyterlab(path: Path, tmp_path: Path) -> dict:
    """``path`` as JupyterLab sends it to be saved after only opening it, its kernel on another
    Python than the notebook's, with another display name: plain JSON, each source and text in
    one string, every cell marked trusted (a transient flag)."""
    saved = nbformat.read(saved_as_jupyterlab_saves(path, tmp_path / "sent.ipynb"), as_version=4)
    content = json.loads(json.dumps(saved))
    content["metadata"]["language_info"]["version"] = "3.0.0"
    content["metadata"]["kernelspec"]["display_name"] = "Python 3 (the reader's)"
    for cell in content["cells"]:
        cell["metadata"]["trusted"] = True
    return content


def save_with_the_hook(path: Path, content: dict) -> dict:
    """The model the server saves after the hook ran on a save of ``content`` over ``path``."""
    model = {"type": "notebook", "format": "json", "content": content}
    manager = SimpleNamespace(root_dir=str(path.parent), log=logging.getLogger(__name__))
    lab_hook.keep_unedited(model=model, path=path.name, contents_manager=manager)
    return model


@pytest.mark.parametrize("path", nbtool.notebook_paths(), ids=lambda p: p.name)
def test_the_hook_saves_a_notebook_only_opened_as_it_was(path, tmp_path):
    sent = sent_by_jupyterlab(path, tmp_path)
    assert server_writes(sent) != path.read_bytes()  # what a plain jupyter lab writes
    model = save_with_the_hook(path, sent)
    assert server_writes(model["content"]) == path.read_bytes()
    assert all(cell.metadata.trusted for cell in model["content"].cells)  # as sent, for signing


def _first_code_cell(content: dict) -> dict:
    return next(c for c in content["cells"] if c["cell_type"] == "code" and c["outputs"])


def _first_text_output(content: dict) -> dict:
    return next(o for c in content["cells"] if c["cell_type"] == "code"
                for o in c["outputs"] if o["output_type"] == "stream")


EDITS = {
    "a source": lambda nb: _first_code_cell(nb).update(source=_first_code_cell(nb)["source"]
                                                       + "\nx = 1"),
    "an output": lambda nb: _first_text_output(nb).update(text=_first_text_output(nb)["text"]
                                                          + "more\n"),
    "an execution count": lambda nb: _first_code_cell(nb).update(execution_count=99),
    "a new cell": lambda nb: nb["cells"].append(nbformat.v4.new_markdown_cell(EDIT)),
    "a deleted cell": lambda nb: nb["cells"].pop(),
    "outputs shown": lambda nb: next(c for c in nb["cells"] if c["metadata"].get(
        "jupyter", {}).get("outputs_hidden"))["metadata"]["jupyter"].pop("outputs_hidden"),
    "the notebook's metadata": lambda nb: nb["metadata"]["collection"].update(title="Retitled"),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_the_hook_saves_an_edit_as_sent(edit, tmp_path):
    path = nbtool.notebook_paths()[0]
    sent = sent_by_jupyterlab(path, tmp_path)
    edit(sent)
    unedited = copy.deepcopy(sent)
    model = save_with_the_hook(path, sent)
    assert model["content"] is sent and sent == unedited


def test_the_hook_leaves_other_saves_alone(tmp_path):
    path = nbtool.notebook_paths()[0]
    sent = sent_by_jupyterlab(path, tmp_path)
    new = save_with_the_hook(tmp_path / "new.ipynb", sent)  # no file there yet
    assert new["content"] is sent
    text = {"type": "file", "format": "text", "content": "x"}
    manager = SimpleNamespace(root_dir=str(path.parent), log=logging.getLogger(__name__))
    lab_hook.keep_unedited(model=text, path=path.name, contents_manager=manager)
    assert text == {"type": "file", "format": "text", "content": "x"}


# ---------------------------------------------------------------------------- the servers


@dataclass
class Lab:
    """A JupyterLab server on a copy of the collection (``hooked``: started by nbtool's `lab`),
    and, once the browser loaded it, a page of it (``reader``)."""

    url: str
    token: str
    root: Path  # the folder it serves: helpers.py, notebooks/, OTHER_PYTHON/, EDITED/
    process: subprocess.Popen
    log: Path
    hooked: bool
    reader: Reader | None = None

    def api(self, path: str, method: str = "GET"):
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            body = answer.read()
        return json.loads(body) if body else None

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def kept(self, path: str) -> bool:
        """Whether the hook logged that it saved ``path`` as it was on disk."""
        return lab_hook.LOG % (path, lab_hook.HOOK) in self.log_text()


def copy_collection(root: Path) -> None:
    """The committed bytes of helpers.py, checkup.py and the notebooks, in ``root``."""
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(nbtool.ROOT / "helpers.py", root)
    shutil.copy(nbtool.ROOT / "checkup.py", root)
    for path in nbtool.notebook_paths():
        shutil.copyfile(path, root / "notebooks" / path.name)
    (root / OTHER_PYTHON).mkdir()
    (root / EDITED).mkdir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_environment(home: Path) -> dict:
    """This process's environment, with Jupyter's and IPython's folders of its own under
    ``home`` (no user config, settings, workspaces, kernels or runtime files)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("JUPYTER", "JPY_", "IPYTHON"))}
    env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"),
               JUPYTERLAB_SETTINGS_DIR=str(home / "user-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), PYTHONNOUSERSITE="1")
    return env


def start_lab(home: Path, hooked: bool) -> Lab:
    """On a free localhost port of a copy of the collection (in ``home``/collection), with a
    token and AUTOSAVE_S: ``python tools/nbtool.py lab --no-browser ...`` (``hooked``), as a
    reader starts it, or a plain ``jupyter lab --no-browser ...``; returns once it answers."""
    root = home / "collection"
    copy_collection(root)
    app_settings = home / "app-settings"  # where JupyterLab reads overrides.json
    app_settings.mkdir()
    (app_settings / "overrides.json").write_text(json.dumps(SETTINGS), encoding="utf-8")
    token = os.urandom(16).hex()
    jupyter_lab = [sys.executable, str(NBTOOL), "lab"] if hooked else [sys.executable, "-m",
                                                                        "jupyterlab"]
    for attempt in range(3):  # another process may take the free port before the server does
        port = _free_port()
        log = home / f"server-{attempt}.log"
        command = [*jupyter_lab, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                   "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}",
                   f"--IdentityProvider.token={token}", f"--LabApp.app_settings_dir={app_settings}",
                   "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp, to read its state
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-root")  # a container's root
        with open(log, "w", encoding="utf-8") as out:
            process = subprocess.Popen(command, cwd=root, env=isolated_environment(home),
                                       stdout=out, stderr=subprocess.STDOUT)
        lab = Lab(f"http://127.0.0.1:{port}", token, root, process, log, hooked)
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while process.poll() is None and time.monotonic() < deadline:
            try:
                lab.api("/api/status")
                return lab
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        stop_lab(lab)
        if "already in use" not in lab.log_tail():
            break
    pytest.fail(f"JupyterLab did not start:\n{lab.log_tail()}")


def stop_lab(lab: Lab) -> None:
    """Shut every kernel and the server down; kill the server if it does not stop."""
    if lab.process.poll() is None:
        try:
            for session in lab.api("/api/sessions"):
                lab.api(f"/api/sessions/{session['id']}", "DELETE")
            lab.api("/api/shutdown", "POST")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
    try:
        lab.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        lab.process.terminate()  # jupyter_server shuts its kernels down on SIGTERM
        try:
            lab.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            lab.process.kill()
            lab.process.wait()


# ---------------------------------------------------------------------------- the reader


class Browser:
    """Headless Chromium, driven by Playwright's sync API from a thread of its own: one thread
    holds one sync Playwright, and tests/test_site.py's may be running in the main one."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="chromium")
        self._state = {}
        self.call(self._start)

    def _start(self):
        from playwright.sync_api import sync_playwright

        self._state["playwright"] = sync_playwright().start()
        self._state["browser"] = self._state["playwright"].chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS)

    def call(self, function, *args, **kwargs):
        """``function(*args, **kwargs)`` in the browser's thread; its result, or its exception."""
        return self._thread.submit(function, *args, **kwargs).result()

    def new_page(self):
        return self.call(lambda: self._state["browser"].new_page(
            viewport={"width": 1400, "height": 900}))

    def close(self):
        def stop():
            if "browser" in self._state:
                self._state["browser"].close()
            if "playwright" in self._state:
                self._state["playwright"].stop()

        try:
            self.call(stop)
        finally:
            self._thread.shutdown()


# The JupyterLab application's objects (exposed as window.jupyterapp) give the real signals: the
# kernel's status, the kernel's own metadata, the document's modified flag, its saves.

WITHIN = """() => {
  window.within = (promise, ms, what) => Promise.race([promise, new Promise((_, fail) =>
    setTimeout(() => fail(new Error(`${what}: not within ${ms} ms`)), ms))]);
}"""

OPEN = """async ([path, ms]) => {
  const widget = await window.within(
    window.jupyterapp.commands.execute('docmanager:open', {path}), ms, 'opening ' + path);
  await window.within(widget.context.ready, ms, 'reading ' + path);
  const seen = {path, saves: [], appliedAt: null, modified: widget.model.dirty};
  widget.context.saveState.connect((_, state) => seen.saves.push(state));
  widget.model.stateChanged.connect((_, change) => {
    if (change.name === 'dirty' && change.newValue) seen.modified = true;
  });
  window.reader = {widget, seen};
}"""

KERNEL_INFO = """async (ms) => {
  const {widget, seen} = window.reader;
  await window.within(widget.sessionContext.ready, ms, 'a session for ' + seen.path);
  const kernel = widget.sessionContext.session?.kernel;
  if (!kernel) throw new Error('no kernel started for ' + seen.path);
  seen.languageInfo = (await window.within(kernel.info, ms, 'the kernel info')).language_info;
  const spec = await window.within(kernel.spec, ms, 'the kernel spec');
  seen.kernelspec = {name: kernel.name, display_name: spec.display_name};
}"""

# true once the kernel is idle with its language_info and spec in the document's metadata, and
# then the document unmodified with no save under way, after a save completed or HOLD_S
SETTLED = """(holdMs) => {
  const {widget, seen} = window.reader;
  const sorted = (v) => (v && typeof v === 'object' && !Array.isArray(v))
    ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, sorted(v[k])])) : v;
  const same = (a, b) => JSON.stringify(sorted(a)) === JSON.stringify(sorted(b));
  const idle = widget.sessionContext.kernelDisplayStatus === 'idle';
  if (seen.appliedAt === null) {
    const spec = widget.model.getMetadata('kernelspec') || {};
    if (idle && same(widget.model.getMetadata('language_info'), seen.languageInfo)
        && spec.name === seen.kernelspec.name
        && spec.display_name === seen.kernelspec.display_name) {
      seen.appliedAt = Date.now();
    }
    return false;
  }
  if (!idle || widget.model.dirty || seen.saves[seen.saves.length - 1] === 'started') {
    return false;
  }
  return seen.saves.includes('completed') || Date.now() - seen.appliedAt >= holdMs;
}"""

# a markdown cell added at the end, as the reader adds one
ADD_CELL = """(source) => {
  const {widget, seen} = window.reader;
  seen.savesBeforeEdit = seen.saves.length;
  widget.model.sharedModel.insertCell(widget.model.cells.length, {cell_type: 'markdown', source});
  seen.modifiedByEdit = widget.model.dirty;
}"""

SAVED_AFTER_ADDING = """() => {
  const {widget, seen} = window.reader;
  return !widget.model.dirty && seen.saves.slice(seen.savesBeforeEdit).includes('completed');
}"""

CLOSE = """async (ms) => {
  const {widget, seen} = window.reader;
  seen.modifiedAtEnd = widget.model.dirty;
  seen.modified ||= widget.model.dirty;
  seen.kernelStatus = widget.sessionContext.kernelDisplayStatus;
  await window.within(widget.sessionContext.shutdown(), ms, 'shutting the kernel down');
  if (widget.model.dirty) {
    widget.dispose();  // no dialog: the test fails on it anyway
  } else {
    widget.close();
  }
  return seen;
}"""


def open_as_a_reader(page, path: str, edit: str | None = None) -> dict:
    """Open ``path`` (relative to the server's root) in ``page``'s JupyterLab as a double-click
    in the file browser does; wait until its kernel is idle with its metadata in the document,
    then until the document is unmodified after a save or HOLD_S; with ``edit``, add a markdown
    cell of that source at the end and wait until a save after it completed. Shut the kernel
    down and close the notebook. Returns what was seen: saves, modified flags, the kernel's
    status and metadata."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.evaluate(OPEN, [path, TIMEOUT_MS])
    page.evaluate(KERNEL_INFO, TIMEOUT_MS)
    timed_out = False
    try:
        page.wait_for_function(SETTLED, arg=HOLD_S * 1000, timeout=TIMEOUT_MS, polling=200)
        if edit is not None:
            page.evaluate(ADD_CELL, edit)
            page.wait_for_function(SAVED_AFTER_ADDING, timeout=TIMEOUT_MS, polling=200)
    except PlaywrightTimeout:
        timed_out = True  # modified and never saved, or the kernel never idle: reported below
    seen = page.evaluate(CLOSE, TIMEOUT_MS)
    page.wait_for_function("() => window.reader.widget.isDisposed")
    return {**seen, "timed_out": timed_out}


class Reader:
    """A page of ``lab``'s JupyterLab in ``browser`` (a fresh workspace), its settings
    checked; ``open`` opens a notebook in it as open_as_a_reader does."""

    def __init__(self, browser: Browser, lab: Lab):
        settings = lab.api("/lab/api/settings/@jupyterlab/docmanager-extension:plugin")
        interval = settings["schema"]["properties"]["autosaveInterval"]["default"]
        assert interval == AUTOSAVE_S, f"overrides.json not read: autosave every {interval} s"
        self.browser = browser
        self.page = page = browser.new_page()
        browser.call(page.set_default_timeout, TIMEOUT_MS)
        browser.call(page.goto, f"{lab.url}/lab?reset&token={lab.token}")
        browser.call(page.wait_for_function, "() => window.jupyterapp !== undefined")
        browser.call(page.evaluate, WITHIN)
        browser.call(page.evaluate, "async (ms) => { await window.within("
                     "window.jupyterapp.restored, ms, 'JupyterLab restored'); }", TIMEOUT_MS)

    def open(self, path: str, edit: str | None = None) -> dict:
        return self.browser.call(open_as_a_reader, self.page, path, edit)

    def close(self) -> None:
        self.browser.call(self.page.close)


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed")
    chromium = Browser()
    try:
        yield chromium
    finally:
        chromium.close()


def _lab_with_a_reader(home: Path, browser: Browser, hooked: bool):
    server = start_lab(home, hooked)
    try:
        server.reader = Reader(browser, server)
        yield server
    finally:
        if server.reader is not None:
            server.reader.close()
        stop_lab(server)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, browser):
    """``python tools/nbtool.py lab``, as the README says to start JupyterLab."""
    yield from _lab_with_a_reader(tmp_path_factory.mktemp("nbtool-lab"), browser, hooked=True)


@pytest.fixture(scope="module")
def plain_lab(tmp_path_factory, browser):
    """A plain ``jupyter lab``: no hook."""
    yield from _lab_with_a_reader(tmp_path_factory.mktemp("jupyter-lab"), browser, hooked=False)


def kernel_left(lab: Lab, path: str) -> bool:
    return any(s["path"] == path for s in lab.api("/api/sessions"))


def bytes_problem(expected: bytes, found: bytes, what: str, expected_name: str = "committed",
                  found_name: str = "after JupyterLab") -> str:
    lines = list(difflib.unified_diff(expected.decode("utf-8").splitlines(),
                                      found.decode("utf-8").splitlines(), expected_name,
                                      found_name, n=1, lineterm=""))
    return f"{what}:\n" + "\n".join(lines[:60]) + (
        f"\n... ({len(lines) - 60} more diff lines)" if len(lines) > 60 else "")


def rewritten_on_opening(path: Path, seen: dict) -> bool:
    """Whether JupyterLab had reason to modify ``path``'s document: its kernel's language_info
    or spec is not the notebook's (on this Python or this kernelspec)."""
    metadata = nbtool.read(path).metadata
    spec = metadata.get("kernelspec", {})
    return (seen["languageInfo"] != metadata.get("language_info")
            or seen["kernelspec"] != {"name": spec.get("name"),
                                      "display_name": spec.get("display_name")})


def other_python_copy(lab: Lab) -> tuple[Path, str]:
    """The first notebook in OTHER_PYTHON/ as a reader on another Python than the notebooks'
    has it: the committed bytes, but where this kernel runs that Python, ``language_info``'s
    version another. Returns its path and its path on the server."""
    path = nbtool.notebook_paths()[0]
    copy = lab.root / OTHER_PYTHON / path.name
    nb = nbtool.read(path)
    if nb.metadata.language_info.version == KERNEL_PYTHON:  # this machine runs that Python
        nb.metadata.language_info.version = "3.0.0"
        nbtool.write(nb, copy)
    else:
        shutil.copyfile(path, copy)  # the committed bytes
    return copy, f"{OTHER_PYTHON}/{path.name}"


# ---------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("path", nbtool.notebook_paths(), ids=lambda p: p.name)
def test_opening_a_notebook_in_nbtool_lab_leaves_its_file_unchanged(lab, path):
    name = f"notebooks/{path.name}"
    copy = lab.root / name
    committed = path.read_bytes()
    assert copy.read_bytes() == committed
    seen = lab.reader.open(name)
    assert not kernel_left(lab, name)
    assert seen["kernelStatus"] == "idle", seen
    assert copy.read_bytes() == committed, bytes_problem(
        committed, copy.read_bytes(), f"{path.name}: JupyterLab rewrote it")
    assert not seen["modifiedAtEnd"] and not seen["timed_out"], seen
    if rewritten_on_opening(path, seen):  # the kernel's Python is not the notebook's
        assert seen["modified"] and seen["saves"][-1:] == ["completed"], seen  # it did save
        assert lab.kept(name), f"the hook did not keep {name}:\n{lab.log_tail()}"
    else:
        assert not seen["modified"] and seen["saves"] == [], seen


def test_a_reader_on_another_python_keeps_the_notebook_in_nbtool_lab(lab):
    """Where the kernel's Python is not the notebook's, JupyterLab marks the notebook modified
    and saves it, whatever this machine's Python; the hook keeps its bytes."""
    copy, name = other_python_copy(lab)
    before = copy.read_bytes()
    seen = lab.reader.open(name)
    assert seen["modified"] and seen["saves"][-1:] == ["completed"], seen
    assert not seen["modifiedAtEnd"] and not seen["timed_out"], seen
    assert copy.read_bytes() == before, bytes_problem(
        before, copy.read_bytes(), f"{name}: JupyterLab rewrote it")
    assert lab.kept(name), f"the hook did not keep {name}:\n{lab.log_tail()}"


def test_an_edit_in_nbtool_lab_is_saved(lab):
    """The hook hides no edit: a markdown cell the reader adds is saved, with what JupyterLab
    rewrites (the kernel's language_info) as it sent it."""
    path = nbtool.notebook_paths()[0]
    name = f"{EDITED}/{path.name}"
    shutil.copyfile(path, lab.root / name)
    seen = lab.reader.open(name, edit=EDIT)
    assert seen["modifiedByEdit"] and not seen["timed_out"], seen
    assert seen["saves"][seen["savesBeforeEdit"]:][-1:] == ["completed"], seen
    saved = nbformat.reads((lab.root / name).read_text(encoding="utf-8"), as_version=4)
    committed = nbtool.read(path)
    assert [c.source for c in saved.cells] == [c.source for c in committed.cells] + [EDIT]
    assert saved.cells[-1].cell_type == "markdown"
    assert saved.metadata.language_info == seen["languageInfo"]  # as JupyterLab sent it


def test_a_reader_on_another_python_gets_the_notebook_rewritten_in_plain_jupyter_lab(plain_lab,
                                                                                       tmp_path):
    """Without the hook, where only the kernel's Python version differs from the notebook's,
    JupyterLab marks the notebook modified and autosaves it: what tests/test_notebooks.py
    simulates, byte for byte (the kernel's language_info, integral floats written as JavaScript
    writes them, the ``collapsed`` flag mirrored from ``jupyter.outputs_hidden``). Nothing in
    the notebook can prevent it; the notebooks' checks pass on what it saved
    (test_notebooks.py)."""
    copy, name = other_python_copy(plain_lab)
    expected = saved_as_jupyterlab_saves(copy, tmp_path / copy.name).read_bytes()
    before = copy.read_bytes()
    seen = plain_lab.reader.open(name)
    assert seen["modified"] and seen["saves"][-1:] == ["completed"], seen
    after = copy.read_bytes()
    assert after != before
    assert after == expected, bytes_problem(
        expected, after, f"{name}: JupyterLab saved other than saved_as_jupyterlab_saves",
        "simulated", "JupyterLab's")
    assert nbformat.reads(after.decode("utf-8"), as_version=4).metadata.language_info.version \
        == KERNEL_PYTHON
    assert not plain_lab.kept(name)
