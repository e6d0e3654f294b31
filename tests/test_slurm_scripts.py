"""The example Slurm scripts under tools/slurm parse, and the training example runs (1 process)."""

from __future__ import annotations

import subprocess
import sys
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
