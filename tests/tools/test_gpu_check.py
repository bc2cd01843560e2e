"""tools/gpu_check.sh: valid bash, and its dry run (on CPU) finds every file and command it needs and
lists every step in its summary."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"
STEPS = ("install", "env", "gpu", "nccl", "parity", "rollout_tests", "rollout_bench", "reshard_bench")


def test_gpu_check_parses_and_dry_runs(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    done = subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60,
                          env={"OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("hybridflow GPU check")[1]
    for step in STEPS:
        assert f"  {step} " in summary, step
    assert (tmp_path / "gpu_check.log").is_file()
