"""JupyterLab that leaves a notebook it only opened as it was (issue 49).

On opening a notebook, JupyterLab writes its kernel's spec and ``language_info`` into the
metadata. Where they differ from the file's (``language_info.version`` is the reader's Python,
rarely the one that executed the notebooks), the notebook is modified, and autosave writes it
back as JavaScript serialized it: 20.0 as 20, a ``collapsed`` flag on each cell whose outputs are
hidden. The reader's ``git pull`` then refuses. No notebook can match every reader's Python.

``keep_unedited`` is a pre-save hook of Jupyter Server's contents manager: where the notebook
being saved equals the file once what the front end alone rewrites is set aside, it saves the
file's own notebook, so that the bytes written are the bytes that were there. Any real edit (a
source, an output, a cell, other metadata) saves as JupyterLab sent it.
``python tools/nbtool.py lab`` starts JupyterLab with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat

HOOK = "tools.lab.keep_unedited"  # what nbtool's `lab` configures (the repository's root on
# the server's sys.path, as nbtool puts it)
LOG = "%s: only what the front end rewrites changed, saved as on disk (%s)"  # path, HOOK


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def unrewritten(text: str) -> str:
    """The notebook ``text`` (JSON, as nbformat writes it) without what JupyterLab rewrites of
    a notebook it only opened: the kernelspec, ``language_info``, each cell's ``collapsed``
    flag, a whole-number float's type (20.0 reads 20). Canonical JSON, to compare."""
    nb = json.loads(text, parse_float=_number)
    for key in ("kernelspec", "language_info"):
        nb.get("metadata", {}).pop(key, None)
    for cell in nb.get("cells", []):
        cell.get("metadata", {}).pop("collapsed", None)
    return json.dumps(nb, sort_keys=True)


def keep_unedited(model: dict, path: str, contents_manager, **kwargs) -> None:
    """A pre-save hook: where ``model`` saves a notebook over a file that differs from it only
    in what the front end rewrites (``unrewritten``), put the file's notebook in its place (the
    cells' transient ``trusted`` flags carried over, so that signing sees what it would have)."""
    file = Path(contents_manager.root_dir, path)
    if model.get("type") != "notebook" or "content" not in model or not file.is_file():
        return
    on_disk = file.read_text(encoding="utf-8")
    sent = nbformat.writes(nbformat.from_dict(model["content"]), version=nbformat.NO_CONVERT)
    if unrewritten(sent) != unrewritten(on_disk):
        return  # edited: saved as sent
    kept = nbformat.reads(on_disk, as_version=nbformat.NO_CONVERT)
    for cell, sent_cell in zip(kept.cells, model["content"]["cells"], strict=True):
        if "trusted" in sent_cell.get("metadata", {}):
            cell.metadata["trusted"] = sent_cell["metadata"]["trusted"]
    model["content"] = kept
    contents_manager.log.info(LOG, path, HOOK)
