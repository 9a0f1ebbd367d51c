"""Record one real check-up trace as test data (issue 51; HTA keeps recorded traces the same way).

Run on a CUDA machine from the repository root:

    python tools/record_checkup_trace.py tests/data/checkup_item_step.json.gz

It runs ``checkup.checkup`` on a small training step that reads its loss with ``.item()`` every
step, and keeps what ``analyze_checkup_trace`` was given (the Chrome trace, the unprofiled step
time, the link's rate) with the findings it made there. ``tests/test_checkup.py`` reads the trace
again on a CPU: the analysis is a pure function of those inputs, so it must find the same.
"""
import gzip
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkup  # noqa: E402

BATCH, WIDTH = 4096, 2048  # about 4 ms of GPU work a step, a few hundred kernels


def train_step(model, optimizer, batch, losses):
    """The reader's step: forward, backward, update, and a loss read every step."""
    x, y = (t.to("cuda", non_blocking=True) for t in batch)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())  # the planted wait: the host stops for the GPU every step


def main(out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = (torch.randn(BATCH, WIDTH).pin_memory(), torch.randn(BATCH, WIDTH).pin_memory())
    losses: list[float] = []
    given = {}
    analyze = checkup.analyze_checkup_trace

    def keep(trace, steps, step_ms=None, loader_ms=None, **kw):
        given.update(trace=trace, steps=steps, step_ms=step_ms, loader_ms=loader_ms, **kw)
        return analyze(trace, steps, step_ms, loader_ms, **kw)

    checkup.analyze_checkup_trace = keep
    report = checkup.checkup(lambda: train_step(model, optimizer, batch, losses), steps=5)
    given["recorded_on"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "python": platform.python_version(), "cpu": platform.processor()
                            or platform.machine()}
    given["findings"] = [[str(f.kind), f.seen, f.cost_ms] for f in report.findings]
    given["summary"] = report.summary()
    with gzip.open(out, "wt") as f:
        json.dump(given, f)
    print(report.summary())
    print(f"{out}: {Path(out).stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main(sys.argv[1])
