"""The benchmark scripts' ``--quick`` smoke runs, two at a time.

Each smoke test (``tests/test_bench_*.py``, ``tests/test_run_all.py``) checks the output of one
run of a benchmark script.  A run starts a fresh Python process per contender, and each of them
imports torch (about 3 s of one core on the CI machine); one after the other, the six runs took
about 230 s of a 730 s suite on 2 cores.  So the first smoke test to ask for its run starts every
run the session selected, ``PARALLEL`` at a time (longest first), and waits for all of them
before it goes on: no other test ever runs beside them (the suite's timing-sensitive tests keep
the machine to themselves), and each smoke test then only reads its run's output.

A run that passes its deadline is killed with its whole process group, and its result says so
(the test then fails with the output the run had printed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARALLEL = 2
DEADLINE = 600.0  # seconds per run, sharing the machine with another one


@dataclass(frozen=True)
class Spec:
    """One run: ``args`` after the interpreter, ``{dir}`` standing for the run's own folder;
    ``cost`` orders the runs, longest first (seconds alone on the CI machine)."""

    args: tuple[str, ...]
    cost: float
    stdin_devnull: bool = False


SPECS: dict[str, Spec] = {
    "loader": Spec(("benchmarks/bench_loader.py", "--quick", "--decode-repeat", "2",
                    "--workdir", "{dir}/work", "--json-out", "{dir}/bench.jsonl"), 90),
    "read": Spec(("benchmarks/bench_read.py", "--quick", "--workdir", "{dir}/work",
                  "--json-out", "{dir}/bench.jsonl"), 67),
    "kept": Spec(("benchmarks/bench_kept.py", "--quick", "--workdir", "{dir}",
                  "--json-out", "{dir}/lines.json"), 26),
    "run_all_stage": Spec(("benchmarks/run_all.py", "--quick", "--only", "stage",
                           "--out", "{dir}/results", "--workdir", "{dir}/work"), 25,
                          stdin_devnull=True),
    "pack": Spec(("benchmarks/bench_pack.py", "--quick", "--workdir", "{dir}/work",
                  "--json-out", "{dir}/bench.jsonl"), 11),
    "stage": Spec(("benchmarks/bench_stage.py", "--quick", "--files", "400",
                   "--workdir", "{dir}", "--json-out", "{dir}/lines.json", "--latency", "0.001"),
                  11),
}


@dataclass
class Run:
    """What one run left: its folder, exit status (None: killed at its deadline), output."""

    name: str
    dir: Path
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    def failure(self) -> str:
        """The message a test fails with when the run did not exit 0."""
        why = (f"killed after {self.seconds:.0f} s (deadline {DEADLINE:.0f} s)"
               if self.returncode is None else f"exit status {self.returncode}")
        return (f"quick run {self.name!r}: {why}\n--- stdout\n{self.stdout}\n"
                f"--- stderr\n{self.stderr}")


def _run(name: str, folder: Path) -> Run:
    spec = SPECS[name]
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, *(a.replace("{dir}", str(folder)) for a in spec.args)]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL if spec.stdin_devnull else None, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=DEADLINE)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the script and every child it started
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        code = None
    return Run(name, folder, code, out, err, time.monotonic() - t0)


class QuickRuns:
    """The runs of ``names`` (started together at the first :meth:`get`), each in its own
    folder under ``base``."""

    def __init__(self, names: set[str], base: Path) -> None:
        unknown = names - set(SPECS)
        if unknown:
            raise ValueError(f"no quick run named {sorted(unknown)}")
        self.names = names
        self.base = base
        self._lock = threading.Lock()
        self._done: dict[str, Run] | None = None

    def get(self, name: str) -> Run:
        with self._lock:
            if self._done is None:
                self._done = self._run_all(self.names | {name})
            elif name not in self._done:  # (a test the collection did not announce)
                self._done[name] = _run(name, self.base / name)
        return self._done[name]

    def _run_all(self, names: set[str]) -> dict[str, Run]:
        order = sorted(names, key=lambda n: -SPECS[n].cost)
        with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            futures = {n: pool.submit(_run, n, self.base / n) for n in order}
            return {n: f.result() for n, f in futures.items()}
