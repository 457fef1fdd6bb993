"""The seed's KV-event scenario against a real vLLM server on a GPU machine.

Not part of CI: run it by hand where a GPU exists, with the python of the
venv where the wheel under test is installed::

    python ci/gpu/seed_scenario_gpu.py --out ci/gpu/seed-scenario.json
    python ci/gpu/seed_scenario_gpu.py --policy none  # a wheel without copy_semantics

It is ``overlay_harness.server_scenario`` with ``--device gpu``: the same
scenario, server flags, subscriber and report as the CPU server test
(``tests/test_cpu_server.py``); only the device's flags differ
(``server_scenario.DEVICES``). ``--help`` lists the options.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness import server_scenario  # noqa: E402

if __name__ == "__main__":
    sys.exit(server_scenario.main(["--device", "gpu", *sys.argv[1:]]))
