"""Record every claim a notebook's kernel checks, for the margin report (`nbtool.py margins`).

Nothing here is imported by the notebooks or by helpers.py: a kernel loads it at start-up from an
IPython profile that `startup_profile` writes, and only when ``COLLECTION_CLAIM_LOG`` names a
file. It wraps ``helpers.claim`` and ``helpers.claim_where`` so that each claim appends one JSON
line (the measured values, the threshold, whether it held, the host) to that file. With
``COLLECTION_CLAIM_MODE=record`` a claim that fails is shown and recorded instead of raised, so
that one run measures every claim of the notebook; otherwise (nbval) it raises as usual and the
checked text is unchanged.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path

LOG = "COLLECTION_CLAIM_LOG"  # the JSON-lines file to append to
MODE = "COLLECTION_CLAIM_MODE"  # "record": a failing claim does not stop the notebook
NOTEBOOK = "COLLECTION_CLAIM_NOTEBOOK"  # the notebook's file name
VERSION = "COLLECTION_CLAIM_VERSION"  # nbtool.run_version: its code and what of helpers it reaches
SOURCE = "COLLECTION_CLAIM_SOURCE"  # what executed it: "margins" or "nbval"
FAILED = "claim fails (recorded, not raised)"


def host() -> dict:
    """The GPU and the host shape this kernel runs on."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "usable_cpus": usable, "host_cpus": os.cpu_count(),
        "torch": torch.__version__, "python": sys.version.split()[0],
        "date": dt.datetime.now(dt.UTC).date().isoformat(),
    }


def _value(measurements: dict, side) -> tuple[float | None, str | None]:
    if isinstance(side, str):
        entry = measurements.get(side)
        return (None, None) if entry is None else (float(entry["value"]), entry["unit"])
    return (None, None) if side is None else (float(side), None)


def entry(helpers, statement: str, lhs, op: str, rhs, factor: float,
          exact: bool = False) -> dict:
    """One claim as the log keeps it: both sides' values and units, and whether it holds. A side
    given as a number (measured in place) has no unit, and an ``lhs`` number is logged as None,
    so that the runs of one claim group by its statement."""
    lhs_value, lhs_unit = _value(helpers.MEASUREMENTS, lhs)
    rhs_value, rhs_unit = _value(helpers.MEASUREMENTS, rhs)
    holds = None
    if lhs_value is not None and rhs_value is not None:
        holds = bool(helpers.OPERATORS[op](lhs_value, factor * rhs_value))
    line = {"statement": statement, "lhs": lhs if isinstance(lhs, str) else None, "op": op,
            "rhs": rhs, "factor": factor, "lhs_value": lhs_value, "lhs_unit": lhs_unit,
            "rhs_value": rhs_value, "rhs_unit": rhs_unit, "holds": holds, "applies": True}
    return {**line, "exact": True} if exact else line


def install(helpers, path: str | os.PathLike, *, record: bool, run: dict) -> None:
    """Wrap ``helpers.claim`` and ``helpers.claim_where`` to append each claim to ``path``.

    ``run`` (notebook, host, source...) is written with every line, so that lines group into
    runs whatever else shares the file."""
    claim, claim_where = helpers.claim, helpers.claim_where

    def append(line: dict) -> None:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({**run, **line}) + "\n")

    def logged_claim(statement, lhs, op, rhs, *, factor=1.0, exact=False):
        line = entry(helpers, statement, lhs, op, rhs, factor, exact)
        append(line)
        if record and line["holds"] is False:
            helpers._emit(f"{FAILED}: {statement}", {"claim": line})
            return None
        return claim(statement, lhs, op, rhs, factor=factor, exact=exact)

    def logged_claim_where(statement, lhs, op, rhs, *, applies, reason, factor=1.0,
                           exact=False):
        if not applies:  # claim_where calls helpers.claim (logged above) when it applies
            append({"statement": statement, "lhs": lhs if isinstance(lhs, str) else None,
                    "op": op, "rhs": rhs, "factor": factor, "applies": False,
                    "reason": reason})
        return claim_where(statement, lhs, op, rhs, applies=applies, reason=reason,
                           factor=factor, exact=exact)

    helpers.claim, helpers.claim_where = logged_claim, logged_claim_where


def install_from_environment(root: Path) -> bool:
    """Import ``root``'s helpers.py under its usual name and wrap its claims, if ``LOG`` is
    set. The notebook's own ``import helpers`` then finds this module, already wrapped."""
    path = os.environ.get(LOG)
    if not path:
        return False
    spec = importlib.util.spec_from_file_location("helpers", root / "helpers.py")
    helpers = importlib.util.module_from_spec(spec)
    sys.modules["helpers"] = helpers
    spec.loader.exec_module(helpers)
    run = {"run": uuid.uuid4().hex[:12], "notebook": os.environ.get(NOTEBOOK),
           "version": os.environ.get(VERSION), "source": os.environ.get(SOURCE, "nbval"),
           **host()}
    install(helpers, path, record=os.environ.get(MODE) == "record", run=run)
    return True


STARTUP = """\
# Written by tools/nbtool.py: wraps helpers' claims so that each is logged (tools/claim_log.py).
import importlib.util as _util
from pathlib import Path as _Path

_spec = _util.spec_from_file_location("claim_log", {module!r})
_claim_log = _util.module_from_spec(_spec)
_spec.loader.exec_module(_claim_log)
_claim_log.install_from_environment(_Path({root!r}))
del _util, _Path, _spec, _claim_log
"""


def startup_profile(directory: Path, root: Path) -> Path:
    """An IPython directory whose default profile loads this module at kernel start; point
    ``IPYTHONDIR`` at it. Returns ``directory``."""
    startup = directory / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "50-claim-log.py").write_text(
        STARTUP.format(module=str(Path(__file__).resolve()), root=str(root)), encoding="utf-8")
    return directory
