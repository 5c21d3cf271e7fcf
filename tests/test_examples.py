"""The example notebooks, executed by a real kernel: values, plots, and only the deliberate errors."""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest

from .nbrun import cell_text, execute

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run(name: str, tmp_path) -> list:
    notebook = execute(nbformat.read(EXAMPLES / name, as_version=4), tmp_path)
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def value_of(cell):
    """The cell's Out[n], rebuilt from its text (lists and dicts of numbers and strings)."""
    import ast

    result = [o for o in cell.outputs if o.output_type == "execute_result"][-1]
    return ast.literal_eval(result.data["text/plain"])


def errors(cells) -> list:
    return [cell for cell in cells if any(output.output_type == "error" for output in cell.outputs)]


def images(cell) -> list:
    return [o for o in cell.outputs if o.output_type in ("display_data", "execute_result") and "image/png" in o.data]


def test_01_quickstart(tmp_path):
    cells = run("01_quickstart.ipynb", tmp_path)
    assert "12.0" in cell_text(cells[1]) and "host 0 of 4 sees 4 devices" in cell_text(cells[1])
    assert "[3., 3.]" in cell_text(cells[2])
    assert "SUCCEEDED" in cell_text(cells[3]) and "0*  succeeded" in cell_text(cells[3])
    assert images(cells[4])  # the timeline
    assert "(16, 36.0)" in cell_text(cells[6])
    assert "ValueError: host 2 found a bad shard" in cell_text(cells[7])
    assert errors(cells) == [cells[7]]  # the deliberate one only


def test_02_jax_data_parallel(tmp_path):
    cells = run("02_jax_data_parallel.ipynb", tmp_path)
    assert errors(cells) == []
    assert "over 16 devices" in cell_text(cells[1])
    assert images(cells[2]) and "parameters back in the notebook: [(8, 32), (32, 1)]" in cell_text(cells[2])
    first, last = (float(v) for v in cell_text(cells[2]).split("loss ")[1].split(";")[0].split(" -> "))
    assert last < first / 4  # it learned
    keras_losses = value_of(cells[3])
    assert "16 devices" in cell_text(cells[3]) and keras_losses[-1] < keras_losses[0]


def test_03_torch_ddp(tmp_path):
    cells = run("03_torch_ddp.ipynb", tmp_path)
    assert errors(cells) == []
    metrics = value_of(cells[1])
    assert metrics["world_size"] == 4 and metrics["weights_in_sync"] is True and metrics["final_loss"] < 0.2


def test_04_failures(tmp_path):
    cells = run("04_failures.ipynb", tmp_path)
    worker, summary, killed, timeout, cancelled, jobs = cells[1:]
    assert errors(cells) == [worker, killed, timeout]
    assert "KeyError: 'host 2 has no shard 20'" in cell_text(worker) and "Reported by host 2" in cell_text(worker)
    assert "    2   failed" in cell_text(summary)
    assert "host 1 was killed by SIGKILL while in the cell" in cell_text(killed) and "about to run out of memory" in cell_text(killed)
    assert "KineticTimeoutError" in cell_text(timeout) and "waiting for a peer that never comes" in cell_text(timeout)
    assert "CANCELLED" in cell_text(cancelled)
    assert cell_text(jobs).splitlines()[0].split() == ["job", "cell", "submitted", "hosts", "accelerator", "state"]


def test_06_sessions(tmp_path):
    cells = run("06_sessions.ipynb", tmp_path)
    _, start, load, build, train, train_more, inspect, plot, failing, after_failure, interrupted, after_interrupt, \
        stop = cells
    assert errors(cells) == [failing, interrupted]
    session_id = re.search(r"session (ks-\S+) \(framework jax\) is up · local · cpu · 4 hosts", cell_text(start)).group(1)
    for cell in (load, build, train, train_more, inspect, failing, after_failure, after_interrupt):
        assert f"· session {session_id} ·" in cell_text(cell)  # every cell ran on the one session
    assert value_of(load) == (4096, 8) and "host 0 of 4 loaded 4096 examples" in cell_text(load)
    assert value_of(build) == "4 devices in the mesh, 4 hosts"
    first, after_40 = (float(v) for v in re.fullmatch(r"step 40: loss (\S+) -> (\S+)", value_of(train)).groups())
    after_120 = float(re.fullmatch(r"step 120: loss (\S+)", value_of(train_more)).group(1))
    assert after_120 < after_40 < first / 4  # it learned, and went on learning from where it was
    assert value_of(inspect) == "every host holds the same parameters: True"
    assert images(plot) and "parameters in the notebook: [(8, 32), (32, 1)]" in cell_text(plot)
    assert "over 120 steps" in cell_text(plot)
    assert "ValueError: host 2 found a bad batch after step 120" in cell_text(failing)
    assert "Reported by host 2" in cell_text(failing)
    assert value_of(after_failure).startswith("still up: step 140, loss")
    assert "CellInterrupted: cell 8 of session" in cell_text(interrupted)  # one line, a KeyboardInterrupt
    assert re.fullmatch(r"interrupted at tick \d+; 140 steps trained, loss \S+", value_of(after_interrupt))
    assert f"session {session_id} stopped" in cell_text(stop)


def test_07_ray(tmp_path, ray_cluster, monkeypatch):
    """On the 4-node test cluster, found through RAY_ADDRESS as a user's would be; nothing of ours is left after."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)  # the kernel inherits it
    cells = run("07_ray.ipynb", tmp_path)
    connect, spread, failing, start, first, second, stop = cells
    assert errors(cells) == [failing]
    assert f"Ray cluster: {ray_cluster.address}" in cell_text(connect)
    nodes = {node["NodeID"][:12] for node in ray_cluster.alive_nodes()}
    assert set(re.findall(r"host \d runs on Ray node (\w+)", cell_text(spread))) == nodes
    assert value_of(spread) == "4 hosts on 4 Ray nodes"
    assert "ValueError: host 2 found a bad shard on Ray node" in cell_text(failing)
    assert "Reported by host 2" in cell_text(failing)
    session_id = re.search(r"session (ks-\S+) \(framework jax\) is up · ray · cpu · 4 hosts", cell_text(start)).group(1)
    assert re.fullmatch(r"host 0 is process \d+ on Ray node (\w+)", value_of(first)).group(1) in nodes
    assert value_of(second) == "same process: True; total after 3 allgathers: [0.0, 3.0, 6.0, 9.0]"
    assert f"session {session_id} stopped" in cell_text(stop)
    assert ray_cluster.wait_until_nothing_is_left() == []


def test_08_ssh(tmp_path, ssh_hosts, monkeypatch):
    """On the four test sshd's, named through the environment as a user's would be (the kernel inherits it)."""
    import sys

    monkeypatch.setenv("KINETIC_SSH_HOSTS", ",".join(ssh_hosts.targets))
    monkeypatch.setenv("KINETIC_SSH_CONFIG", ssh_hosts.config)
    monkeypatch.setenv("KINETIC_SSH_PYTHON", str(pathlib.Path(sys.base_prefix) / "bin" /
                                                 f"python{sys.version_info[0]}.{sys.version_info[1]}"))
    cells = run("08_ssh.ipynb", tmp_path)
    hosts, every, jax_cell, failing, start, first, second, stop = cells
    assert errors(cells) == [failing]
    assert "hosts: h0,h1,h2,h3" in cell_text(hosts)
    assert value_of(every) == "4 ssh hosts ran this cell"
    assert all(f"host {index} runs as process" in cell_text(every) for index in range(4))
    assert value_of(jax_cell) == "4 processes, allgather total 12.0"
    assert "ValueError: host 2 found a bad shard" in cell_text(failing) and "Reported by host 2" in cell_text(failing)
    assert "is up · ssh" in cell_text(start)
    assert (value_of(first), value_of(second)) == (0, 1)
    assert "stopped" in cell_text(stop)


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", "02_jax_data_parallel.ipynb", "03_torch_ddp.ipynb",
                                  "04_failures.ipynb", "06_sessions.ipynb", "07_ray.ipynb", "08_ssh.ipynb"])
def test_examples_are_committed_without_outputs(name):
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")


def test_05_gke_cells_are_valid_ipython_and_name_what_they_need():
    """05 needs a cluster, so CI does not run it; its cells must still parse, magics included."""
    from IPython.core.inputtransformer2 import TransformerManager

    notebook = nbformat.read(EXAMPLES / "05_gke.ipynb", as_version=4)
    transform = TransformerManager().transform_cell
    for cell in notebook.cells:
        if cell.cell_type == "code":
            compile(transform(cell.source), "<05_gke>", "exec")
    text = "\n".join(cell.source for cell in notebook.cells)
    assert "-b kubernetes" in text and "docs/gke.md" in text
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    # The prebuilt image mode: no image to build or name; the doctor is the first cell after the setup.
    assert not re.search(r"KineticMagics\.image|KINETIC_IMAGE|--image", text)
    assert "%config KineticMagics.requirements" in code[0]
    assert code[1].startswith("%kinetic doctor -a tpu-v5e-16")
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
