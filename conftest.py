"""pytest hooks for the notebook tier (nbval runs every notebook, one item per code cell).

- Without CUDA, a notebook's cells run up to its first code cell not tagged ``cpu-ok``; that
  cell and every later one are skipped with the reason "requires CUDA". A notebook whose
  metadata says ``collection.requires_gpus: N`` is skipped the same way, with the reason
  "requires N GPUs", where fewer are visible.
- Figures saved during a test run go to a temporary folder.
- After a cell fails, the rest of its notebook is skipped, so one failure reads as one failure
  and not as a cascade of NameErrors.
- With ``COLLECTION_CLAIM_LOG=FILE`` set, every claim the notebooks check is also appended to
  FILE with its measured values (tools/claim_log.py); `python tools/nbtool.py margins --add
  FILE` keeps those runs for the margin report. Claims still raise, so the run is CI's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

CPU_OK_TAG = "cpu-ok"
_failed_notebooks: set[str] = set()
_own_figures_dir: str | None = None
_claim_log_dir: str | None = None
_claims_logged_for: str | None = None  # the notebook whose kernel the environment names


def pytest_configure(config):
    # Notebooks re-run under test save their figures here, not over the committed ones
    # (the kernels nbval starts inherit this environment).
    global _own_figures_dir
    if "COLLECTION_FIGURES_DIR" not in os.environ:
        _own_figures_dir = tempfile.mkdtemp(prefix="figures-")
        os.environ["COLLECTION_FIGURES_DIR"] = _own_figures_dir
    # No reader types guesses here: an empty prediction cell passes (helpers.expect_guess); and
    # a claim that fails stops its notebook, as in a committed run (helpers.claim)
    os.environ.setdefault("COLLECTION_GUESSES", "skip")
    os.environ.setdefault("COLLECTION_STRICT_CLAIMS", "1")
    global _claim_log_dir
    if os.environ.get("COLLECTION_CLAIM_LOG"):
        _claim_log_dir = tempfile.mkdtemp(prefix="claim-log-")


def pytest_unconfigure(config):
    # Repeated runs on one machine must not fill its disk with figure folders.
    for made in (_own_figures_dir, _claim_log_dir):
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def _log_claims_of(item) -> None:
    """Before a notebook's kernel starts, tell it which notebook it runs (for the claim log)."""
    from tools import nbtool

    path = Path(str(item.parent.fspath))
    os.environ.update(nbtool.claim_log_environment(
        Path(os.environ["COLLECTION_CLAIM_LOG"]).resolve(), path, item.parent.nb, "nbval",
        False, Path(_claim_log_dir) / "ipython"))


def _is_notebook_cell(item) -> bool:
    return hasattr(item, "cell") and hasattr(item.parent, "nb")


def pytest_collection_modifyitems(config, items):
    cells = [item for item in items if _is_notebook_cell(item)]
    if not cells:
        return
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    past_cpu_part: set[str] = set()
    for item in cells:
        needed = item.parent.nb.metadata.get("collection", {}).get("requires_gpus", 1)
        if visible >= needed:
            continue
        notebook = item.parent.nodeid
        if CPU_OK_TAG not in item.cell.get("metadata", {}).get("tags", []):
            past_cpu_part.add(notebook)
        if notebook in past_cpu_part:
            reason = "requires CUDA" if visible == 0 else f"requires {needed} GPUs"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _is_notebook_cell(item):
        _failed_notebooks.add(item.parent.nodeid)


@pytest.hookimpl(tryfirst=True)  # before nbval starts the notebook's kernel
def pytest_runtest_setup(item):
    global _claims_logged_for
    if _claim_log_dir is not None and _is_notebook_cell(item) \
            and item.parent.nodeid != _claims_logged_for:  # once per notebook: hashing helpers
        _log_claims_of(item)
        _claims_logged_for = item.parent.nodeid
    if _is_notebook_cell(item) and item.parent.nodeid in _failed_notebooks:
        pytest.skip("an earlier cell of this notebook failed")
