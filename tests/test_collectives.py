"""On gloo the sharded job's reduce-scatter and all-gather are rings of point-to-point messages:
they must equal torch's own collectives, in place, for any group size and dtype."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.integration  # every test here starts processes (docs/testing.md)


@pytest.mark.parametrize("ranks", [2, 3])  # 2: also over a second connection per pair
def test_ring_collectives_equal_torchs(ranks):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
         str(ROOT / "tests" / "workers" / "collectives_worker.py")],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
