"""The example Slurm scripts under tools/slurm parse, and the training example runs (1 process)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardio import PackOptions, pack

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "tools" / "slurm"


def test_batch_scripts_parse() -> None:
    for script in SLURM.glob("*.sbatch"):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)
        assert "#SBATCH" in script.read_text()


def test_training_example_runs_and_resumes(image_tree: Path, tmp_path: Path) -> None:
    data = tmp_path / "ds"
    pack(image_tree, data, PackOptions(samples_per_shard=20, fsync=False))
    (tmp_path / "cache").mkdir()
    cmd = [sys.executable, str(SLURM / "train_example.py"), str(data), "--cache",
           str(tmp_path / "cache"), "--ckpt", str(tmp_path), "--epochs", "2", "--batch-size", "8",
           "--workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1:" in proc.stdout


def _fake_slurm(bin_dir: Path, log: Path) -> None:
    """``srun`` and ``scontrol`` that only record their arguments, and ``python`` (the one
    running the tests), on a PATH for train.sbatch."""
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/bash\necho "{name} $*" >> "{log}"\n')
        tool.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)


def test_job_script_resumes_the_epoch_the_training_example_saved(image_tree: Path,
                                                                 tmp_path: Path) -> None:
    """train.sbatch stages the epoch the loader checkpoint records.  It read ``loader.json``,
    which train_example.py never writes (it saves ``loader-rank{rank}.json``): every requeued
    job staged epoch 0 whatever epoch it resumed."""
    data, ckpt, cache = tmp_path / "ds", tmp_path / "ckpt", tmp_path / "cache"
    pack(image_tree, data, PackOptions(samples_per_shard=20, fsync=False))
    ckpt.mkdir()
    cache.mkdir()
    cmd = [sys.executable, str(SLURM / "train_example.py"), str(data), "--cache", str(cache),
           "--ckpt", str(ckpt), "--epochs", "100000", "--batch-size", "8", "--workers", "1"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 120
        assert job.stdout is not None
        while True:  # epochs 0 and 1 done: the position is past epoch 0
            assert time.monotonic() < deadline, "the training example made no progress"
            ready, _, _ = select.select([job.stdout], [], [], 1.0)
            if ready:
                line = job.stdout.readline()
                assert line, job.communicate(timeout=60)[1]
                if line.startswith("epoch 1:"):
                    break
        job.send_signal(signal.SIGUSR1)  # Slurm's warning (--signal=USR1@120)
        _out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    assert job.returncode == 0, err
    assert (ckpt / "PREEMPTED").exists()
    [saved] = ckpt.glob("*.json")  # the loader checkpoint, whatever its name
    epoch = json.loads(saved.read_text())["epoch"]
    assert epoch >= 1  # (not the 0 a missing file gives)

    log = tmp_path / "slurm.log"
    _fake_slurm(tmp_path / "bin", log)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", CKPT=str(ckpt),
               SLURM_TMPDIR=str(cache), SLURM_NTASKS_PER_NODE="1", SLURM_JOB_ID="42")
    proc = subprocess.run(["bash", str(SLURM / "train.sbatch"), str(data)], env=env, check=False,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    [stage] = [c for c in calls if " shardio stage " in c]
    assert f"--epochs {epoch}..{epoch + 1} " in stage, (epoch, stage)
    assert "scontrol requeue 42" in calls and not (ckpt / "PREEMPTED").exists()
