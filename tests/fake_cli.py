"""`python tests/fake_cli.py ARGS`: the real CLI (Hydra, config, sinks, signals), with FakeWorkers for verl.

For bookkeeping tests that need a separate process (W&B's service killed under it, a second process on a held run
dir, Ctrl-C). FAKE_GATE_STEP and
FAKE_GATE_FILE make the fake wait before that step until the file exists; FAKE_DRIFT_AT makes rank 1's group 0
hold another lr after that step.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import tinker_exp.assemble  # noqa: E402
import tinker_exp.main  # noqa: E402
from fakes import fake_workers  # noqa: E402

gate = (int(os.environ["FAKE_GATE_STEP"]), Path(os.environ["FAKE_GATE_FILE"])) if "FAKE_GATE_FILE" in os.environ else None
drift_at = int(os.environ["FAKE_DRIFT_AT"]) if "FAKE_DRIFT_AT" in os.environ else None
tinker_exp.assemble.verl_workers = fake_workers(gate=gate, drift_at=drift_at)
tinker_exp.main.main()
