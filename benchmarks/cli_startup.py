"""Start-up time and peak memory of the ``dsv41`` command against importing the package (the baseline: what every
``dsv41`` call cost while the command imported the model up front).

Each case runs ``--repeat`` times in fresh processes, in this run, alternating with the baseline; the table shows
the median wall time, the peak RSS and the ratio to the baseline. The console script is stood in for by a file
named ``dsv41`` holding what pip writes into it.

    python benchmarks/cli_startup.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = "import sys\nfrom modeling_dsv41.cli import main\nsys.exit(main())\n"


def _run(command: list[str], expected_status: int) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != expected_status:
        raise RuntimeError(f"{command} exited with {process.returncode}")
    return seconds, usage.ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "dsv41"
        script.write_text(CONSOLE_SCRIPT)
        cases = {  # name → (command, exit status)
            "baseline: python -c 'import modeling_dsv41'": ([sys.executable, "-c", "import modeling_dsv41"], 0),
            "dsv41 --help": ([sys.executable, str(script), "--help"], 0),
            "dsv41 demo --steps 0 (usage error)": ([sys.executable, str(script), "demo", "--steps", "0"], 2),
            "python -m modeling_dsv41.cli --help": ([sys.executable, "-m", "modeling_dsv41.cli", "--help"], 0),
        }
        times = {name: [] for name in cases}
        peaks = {name: [] for name in cases}
        for _ in range(args.repeat):
            for name, (command, status) in cases.items():
                seconds, peak = _run(command, status)
                times[name].append(seconds)
                peaks[name].append(peak)
    baseline = statistics.median(times[next(iter(cases))])
    print(f"{'case':<42}{'median s':>10}{'vs baseline':>13}{'peak MiB':>10}")
    for name in cases:
        median = statistics.median(times[name])
        print(f"{name:<42}{median:>10.2f}{median / baseline:>12.3f}x{max(peaks[name]) / 2**20:>10.0f}")
    print(f"({args.repeat} runs each, alternating, on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
