"""python -m kinetic_nb.runner on a platform without a supervisor uploads its own log."""

from __future__ import annotations

import os
import subprocess
import sys

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.plan import make_plan, prepare_cell
from kinetic_nb.runner import protocol
from kinetic_nb.runner.logs import read_log
from kinetic_nb.storage import LocalStorage


def test_a_lone_runner_uploads_python_and_c_level_output(tmp_path):
    storage = LocalStorage(str(tmp_path / "kn-20261129-000000-abcdef"))
    source = "import os\nprint('from python')\nos.write(1, b'from the fd itself\\n')\n'value'"
    payload = prepare_cell(source, {}, filename="<cell>")
    plan = make_plan(job_id="kn-20261129-000000-abcdef", acc=resolve_accelerator("cpu"), hosts=1, framework="none",
                     coordinator_address="127.0.0.1:1", payload=payload, simulated=True)
    storage.write_bytes(protocol.PAYLOAD, payload.data)
    storage.write_bytes(protocol.PLAN, plan.to_json())
    env = {k: v for k, v in os.environ.items() if not k.startswith("KINETIC_")}
    completed = subprocess.run([sys.executable, "-m", "kinetic_nb.runner", "--job", storage.uri],
                               env={**env, "KINETIC_LOG_UPLOAD": "1"}, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert "from python" in completed.stdout and "from the fd itself" in completed.stdout  # kubectl logs still work
    log = read_log(storage, 0)
    assert "from python\n" in log and "from the fd itself\n" in log
    assert storage.exists(protocol.RESULT)
