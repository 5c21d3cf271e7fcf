"""The panel rendered by JupyterLab in headless Chromium, driven by Playwright.

The tests start their own JupyterLab server on a free port. One opens a
notebook whose 4-host cell sleeps in steps and then fails on host 3, and
watches the panel go from running to failed; the other starts a session and
reads what its cells' panels end as. Screenshots land in build/test-output/
(the 256-host grid's in docs/images/scale/ with KINETIC_UPDATE_SCREENSHOTS=1).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook
from playwright import sync_api as playwright_api

import kinetic_nb

OUTPUT = pathlib.Path(__file__).resolve().parent.parent / "build" / "test-output"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
CELL = """%%kinetic -n 4
import os, time
host = int(os.environ['RANK'])
for step in range(8):
    print(f'step {step} on host {host}', flush=True)
    time.sleep(0.5)
if host == 3:
    raise ValueError('host 3 lost its shard')
'done'"""


#: Host 2 holds 600 MiB more than the others at the cell's end: the panel flags it.
MEMORY_CELL = """%%kinetic -n 4 --framework none
import os
if os.environ['RANK'] == '2':
    held = b'\\x01' * (600 * 2**20)
print('done', flush=True)"""


SESSION_CELLS = [
    "%kinetic start -n 3 --framework none --idle-timeout 120",
    "%%kinetic\n'trivial'",
    "%%kinetic\nimport os\nprint('working', flush=True)\nif os.environ['RANK'] == '2':\n    raise ValueError('bad shard')",
    "%kinetic stop",
]


#: Every way a cell ends (#39's table), as a one-shot and as a session cell; the kernel is interrupted as
#: JupyterLab's stop button does it (SIGINT to the kernel), from a timer armed by the cell before.
INTERRUPT_IN = ("import os, signal, threading\n"
                "threading.Timer({}, lambda: os.kill(os.getpid(), signal.SIGINT)).start()")
HOST = "int(os.environ['KINETIC_HOST_INDEX'])"
ENDINGS = {
    "interrupted": ("", "import time\nprint('working', flush=True)\ntime.sleep(60)", 2.0),
    "killed": ("", f"import os, time\nprint('this cell', flush=True)\ntime.sleep(0.5)\nif {HOST} == 1:\n"
                   "    os._exit(3)\ntime.sleep(4)", None),
    "raised": ("", f"import os, time\nprint('this cell', flush=True)\nif {HOST} == 2:\n"
                   "    raise ValueError('host 2 broke')\n'done'", None),
    "timed-out": ("--timeout 3", "import time\nprint('this cell', flush=True)\ntime.sleep(60)", None),
    "printed": ("", "import sys, time\nfor i in range(10_000):\n    print(f'line {i}')\n"
                    "for p in range(0, 101, 25):\n    print(f'\\rprogress {p}%', end='', flush=True)\n"
                    "    time.sleep(0.1)\nprint()\n'printed'", None),
}


#: A cell whose hosts print a line a second for 6 s, all the same but host 5's: the browser's cost of drawing
#: its panel is measured at 16 and 256 hosts, and its last lines are grouped.
STEPS_CELL = """%%kinetic -n {hosts} --framework none
import os, time
host = int(os.environ['KINETIC_HOST_INDEX'])
for step in range(6):
    print(f'step {{step}} loss {{0.61 if host == 5 else 0.53}}', flush=True)
    time.sleep(1)"""
#: 256 hosts: 252 end at once, hosts 100-102 sleep without a word (quiet, 3 s after the others ended), and host
#: 77 keeps printing (the slowest) and then raises.
SCALE_CELL = """%%kinetic -n 256 --framework none --grace 3
import os, time
host = int(os.environ['KINETIC_HOST_INDEX'])
if host in (100, 101, 102):
    time.sleep(120)
elif host == 77:
    for step in range(40):
        print(f'step {step} loss 0.53', flush=True)
        time.sleep(0.5)
    raise ValueError('host 77 lost its shard')
print('step 10 loss 0.53', flush=True)"""
#: 256 hosts on this machine: light ones (test only), as benchmarks/scale.py starts them.
LIGHT_HOSTS = "import os\nos.environ['KINETIC_LIGHT_HOSTS'] = '1'"
#: Where the 256-host screenshots go: build/test-output/scale/, or, with KINETIC_UPDATE_SCREENSHOTS=1 (after an
#: intended change to what the panel shows), docs/images/scale/, which the README shows: a run leaves git clean.
SCALE_IMAGES = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "images" / "scale"
                if os.environ.get("KINETIC_UPDATE_SCREENSHOTS") == "1" else OUTPUT / "scale")
#: What the page counts while the cells run: each output area's changes (a MutationObserver's batches).
COUNT_UPDATES = """() => {
    window.knUpdates = new Map();
    new MutationObserver(batch => {
        for (const change of batch) {
            const area = change.target.parentElement && change.target.parentElement.closest('.jp-CodeCell');
            if (area) { window.knUpdates.set(area, (window.knUpdates.get(area) || 0) + 1); break; }
        }
    }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def endings_cells() -> tuple[list[str], dict[tuple[str, str], int]]:
    """The endings notebook's cells after ``%load_ext``, and where each ending's kinetic cell is."""
    cells: list[str] = []
    where: dict[tuple[str, str], int] = {}
    for kind in ("one-shot", "session"):
        if kind == "session":
            cells.append("%kinetic start -n 4 --framework none")
        for name, (flags, source, interrupt_at) in ENDINGS.items():
            if kind == "session" and name == "killed":
                continue  # last: it ends the session
            if interrupt_at is not None:
                cells.append(INTERRUPT_IN.format(interrupt_at))
            cells.append(f"%%kinetic {'-n 4 ' if kind == 'one-shot' else ''}{flags}\n{source}")
            where[kind, name] = len(cells)
    cells.append("_session = get_ipython().magics_manager.registry['KineticMagics'].session\n"
                 "_running = _session.run(\"import time\\nprint('the running cell', flush=True)\\ntime.sleep(5)\")\n"
                 "import time; time.sleep(0.5)\n" + INTERRUPT_IN.format(1.0))
    cells.append("%%kinetic\nprint('the queued cell', flush=True)")
    where["session", "withdrawn"] = len(cells)
    cells.append("_running.result()")
    flags, source, _ = ENDINGS["killed"]
    cells.append(f"%%kinetic\n{source}")
    where["session", "killed"] = len(cells)
    cells.append("%kinetic stop")
    return cells, where


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    for name, cells in (("panel.ipynb", [CELL]), ("session.ipynb", SESSION_CELLS), ("memory.ipynb", [MEMORY_CELL]),
                        ("endings.ipynb", endings_cells()[0]),
                        ("scale.ipynb", [LIGHT_HOSTS, STEPS_CELL.format(hosts=16), STEPS_CELL.format(hosts=256),
                                         SCALE_CELL])):
        # A cell tagged raises-exception fails without stopping "Run All Cells" (the session is stopped after).
        notebook = new_notebook(cells=[new_code_cell("%load_ext kinetic_nb"), *(
            new_code_cell(cell, metadata={"tags": ["raises-exception"]} if "%%kinetic" in cell or "raise" in cell
                          else {})
            for cell in cells)])
        notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(notebook, root / name)
    port, token = _free_port(), secrets.token_hex(16)
    server_log = open(root / "server.log", "wb")  # noqa: SIM115 - the server writes it for the fixture's life
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=subprocess.DEVNULL, stderr=server_log, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as response:
                json.load(response)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"JupyterLab did not start: {(root / 'server.log').read_text()[-2000:]}") from None
            time.sleep(0.25)
    # A workspace per notebook: JupyterLab would otherwise reopen the other test's notebook beside it.
    yield lambda name: f"{base}/lab/workspaces/{name.split('.')[0]}/tree/{name}?token={token}"
    server.terminate()
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextlib.contextmanager
def notebook_run(url: str, screenshot: str, height: int):
    """A headless Chromium page on the notebook at ``url``, every cell run; a screenshot at the end (or of a
    failure) in build/test-output/."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is needed: .ci/run installs Debian's chromium package"
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": height})
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=60_000)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()
            yield page
            page.screenshot(path=str(OUTPUT / f"{screenshot}.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(OUTPUT / f"{screenshot}-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def test_the_panel_goes_live_in_jupyterlab(jupyterlab):
    with notebook_run(jupyterlab("panel.ipynb"), "panel", 1000) as page:
        panel = page.locator(".jp-OutputArea .widget-vbox").first
        panel.wait_for(timeout=60_000)
        page.get_by_text("RUNNING", exact=False).first.wait_for(timeout=60_000)
        running_rows = panel.locator(".widget-html", has_text="running")
        running_rows.first.wait_for(timeout=60_000)

        page.get_by_text("FAILED", exact=False).first.wait_for(timeout=90_000)
        rows = panel.locator(".widget-html-content > div[style*='font-size:12px']")
        assert rows.count() == 4
        # Widget updates arrive as separate messages: wait for the row's, not only the header's.
        playwright_api.expect(rows.nth(3)).to_contain_text("failed", timeout=30_000)
        page.get_by_text("host 3 · failed · in the cell").click()
        traceback = panel.get_by_text("ValueError: host 3 lost its shard").first
        traceback.wait_for(state="visible", timeout=10_000)
        assert "raise ValueError('host 3 lost its shard')" in panel.inner_text()
        # Under the traceback, the variables of the frame it was raised in, as host 3 described them.
        panel.get_by_text("variables where it was raised (Cell line", exact=False).first.wait_for(timeout=10_000)
        assert "host = 3" in panel.inner_text() and "step = 7" in panel.inner_text()
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                            has_text="ValueError").count() >= 1
        news = page.get_by_role("button", name="No", exact=True)
        if news.count():
            news.first.click()  # JupyterLab's news prompt would cover the panel
            page.get_by_text("Would you like to get notified").wait_for(state="hidden", timeout=10_000)
    assert (OUTPUT / "panel.png").stat().st_size > 10_000


def test_the_panel_shows_each_hosts_memory_and_flags_the_host_above_the_others(jupyterlab):
    """What a reviewer sees in build/test-output/memory-panel.png (docs/images/memory.png is one such)."""
    with notebook_run(jupyterlab("memory.ipynb"), "memory-panel", 900) as page:
        page.get_by_text("SUCCEEDED", exact=False).first.wait_for(timeout=120_000)
        panel = page.locator(".jp-OutputArea .widget-vbox").first
        flag = panel.get_by_text("host 2 holds", exact=False).first
        flag.wait_for(timeout=30_000)
        assert "of resident memory" in flag.inner_text() and "the others' median" in flag.inner_text()
        assert "memory: host 0 " in panel.inner_text()
        assert panel.get_by_text("host 0 holds", exact=False).count() == 0
        page.get_by_text("host 2 · succeeded", exact=False).first.click()
        figures = panel.get_by_text("resident (peak", exact=False).nth(2)  # host 2's drill-down
        figures.wait_for(state="visible", timeout=10_000)
        assert figures.inner_text().startswith("memory: 6")  # 600 MiB and more
        news = page.get_by_role("button", name="No", exact=True)
        if news.count():
            news.first.click()
            page.get_by_text("Would you like to get notified").wait_for(state="hidden", timeout=10_000)
    assert (OUTPUT / "memory-panel.png").stat().st_size > 10_000


def test_a_session_cells_panel_ends_as_a_one_shot_jobs_does(jupyterlab):
    try:
        with notebook_run(jupyterlab("session.ipynb"), "session-panel", 1400) as page:
            page.get_by_text("stopped: its 3 hosts", exact=False).wait_for(timeout=120_000)
            cells = page.locator(".jp-Notebook .jp-CodeCell")
            start, trivial, failing = (cells.nth(i).locator(".jp-OutputArea") for i in (1, 2, 3))
            # %kinetic start shows the panel, one line once the hosts are up (not a table that wraps).
            started = start.locator(".widget-vbox").first.inner_text()
            assert re.match(r"session ks-\S+ \(framework none\) is up · local · cpu · 3 hosts · .* · SUCCEEDED\s+3 idle$", started), started
            # A trivial cell: one line above its value, naming the cell as the notebook does.
            header = trivial.locator(".widget-vbox").first
            assert header.inner_text().startswith("In[3] · session ks-")
            assert header.bounding_box()["height"] < 40
            assert "'trivial'" in trivial.inner_text()
            # A failed cell: a full bar labelled in full, each host in the phase its cell ended in.
            panel = failing.locator(".widget-vbox").first
            label = panel.locator(".widget-label", has_text="FAILED").first
            assert label.inner_text() == "FAILED"
            assert label.evaluate("element => element.scrollWidth <= element.clientWidth")  # not "FAIL..."
            assert panel.locator("progress, .progress-bar").count() >= 1
            rows = panel.locator(".widget-html-content > div[style*='font-size:12px']")
            assert rows.count() == 3
            texts = [rows.nth(i).inner_text() for i in range(3)]
            assert "shutting down" not in " ".join(texts) and "in the cell" in texts[2] and "failed" in texts[2]
            assert re.search(r"host 2: ValueError at In\[\d+\], line 5", panel.inner_text())
            panel.get_by_text("host 2 · failed · in the cell").click()
            panel.get_by_text("raise ValueError('bad shard')").first.wait_for(state="visible", timeout=10_000)
            panel.get_by_text("host 1 · succeeded", exact=True).click()  # done: no phase
            panel.get_by_text("working").first.wait_for(state="visible", timeout=10_000)
            # The host's traceback as IPython draws one: the arrow on the line that raised.
            error = failing.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            assert "----> 5 raise ValueError('bad shard')" in error.inner_text().replace("\u00a0", " ")
    finally:
        for left in kinetic_nb.sessions():  # a session the notebook did not get to stop
            if left["state"] == "up":
                kinetic_nb.attach_session(left["session_id"], echo=False).stop()


def test_every_way_a_cell_ends_is_drawn_as_it_ended(jupyterlab):
    """The panel's last state in JupyterLab for each ending, one-shot and session: the outcome (never RUNNING),
    a stop grey, never red. Each panel's screenshot is in build/test-output/ending-*.png (docs/images/ keeps
    some)."""
    _, where = endings_cells()
    try:
        with notebook_run(jupyterlab("endings.ipynb"), "endings", 1400) as page:
            page.get_by_text("stopped: its 4 hosts", exact=False).wait_for(timeout=300_000)
            cells = page.locator(".jp-Notebook .jp-CodeCell")
            expected = {"interrupted": "INTERRUPTED", "killed": "FAILED", "raised": "FAILED", "timed-out": "TIMED OUT",
                        "printed": "SUCCEEDED", "withdrawn": "WITHDRAWN"}
            for (kind, ending), index in where.items():
                cell = cells.nth(index)
                cell.scroll_into_view_if_needed()
                output = cell.locator(".jp-OutputArea")
                header, rendered_by = "", time.monotonic() + 30
                while " · " not in header and time.monotonic() < rendered_by:  # drawn once scrolled to
                    header = output.inner_text().strip().split("\n", 1)[0]
                    time.sleep(0.1)
                assert "RUNNING" not in header and expected[ending] in header, (kind, ending, output.inner_text()[:300])
                badges = output.locator(".widget-vbox").first.locator("span[style*='background:#e53935']")
                assert badges.count() == (1 if ending in ("killed", "raised") else 0), (kind, ending, badges.count())
                cell.screenshot(path=str(OUTPUT / f"ending-{kind}-{ending}.png"))
            printed_cell = cells.nth(where["one-shot", "printed"])
            printed_cell.scroll_into_view_if_needed()
            printed, rendered_by = "", time.monotonic() + 30
            while "line 9999" not in printed and time.monotonic() < rendered_by:
                printed = printed_cell.locator(".jp-OutputArea").inner_text()
                time.sleep(0.1)
            assert "line 9999" in printed and "progress 100%" in printed and "progress 25%" not in printed
    finally:
        for left in kinetic_nb.sessions():  # a session the notebook did not get to stop
            if left["state"] == "up":
                kinetic_nb.attach_session(left["session_id"], echo=False).stop()


def _browser_ms(cdp) -> float:
    """The page's main-thread time so far (Chromium's own accounting: scripts, style, layout, paint), in ms."""
    metrics = {metric["name"]: metric["value"] for metric in cdp.send("Performance.getMetrics")["metrics"]}
    return metrics["TaskDuration"] * 1000


def _wait_for_header(output, word: str, timeout_s: float) -> str:
    header, deadline = "", time.monotonic() + timeout_s
    while word not in header and time.monotonic() < deadline:
        header = output.inner_text().strip().split("\n", 1)[0] if output.count() else ""
        time.sleep(0.05)
    assert word in header, header
    return header


def test_a_256_host_cell_draws_a_grid_the_hosts_that_differ_and_grouped_lines(jupyterlab):
    """16 and 256 hosts printing the same lines (the browser's cost of each panel is measured and printed), then
    256 hosts with one failed and three quiet: the grid, the hosts that differ and the grouped lines, looked at
    in build/test-output/scale/ (docs/images/scale/ with KINETIC_UPDATE_SCREENSHOTS=1)."""
    SCALE_IMAGES.mkdir(parents=True, exist_ok=True)
    with notebook_run(jupyterlab("scale.ipynb"), "scale", 3000) as page:  # every cell in view, drawn
        page.evaluate(COUNT_UPDATES)
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        costs = {}
        for index, hosts in ((2, 16), (3, 256)):
            output = cells.nth(index).locator(".jp-OutputArea")
            _wait_for_header(output, "RUNNING", 120)
            started, browser = time.monotonic(), _browser_ms(cdp)
            _wait_for_header(output, "SUCCEEDED", 120)
            seconds, browser = time.monotonic() - started, _browser_ms(cdp) - browser
            updates = cells.nth(index).evaluate("cell => window.knUpdates.get(cell) || 0")
            costs[hosts] = (browser / seconds, browser / max(updates, 1), updates)
        for hosts, (per_second, per_update, updates) in costs.items():
            print(f"browser main thread while a {hosts}-host cell ran: {per_second:.1f} ms/s, {updates} output "
                  f"changes, {per_update:.2f} ms each; vs 16 hosts: {per_second / costs[16][0]:.2f}x")
        assert all(updates > 0 for _, _, updates in costs.values())  # measured, never asserted on

        grouped = cells.nth(3)
        grouped.scroll_into_view_if_needed()
        panel = grouped.locator(".widget-vbox").first
        playwright_api.expect(panel.locator(".kn-grid i")).to_have_count(256, timeout=30_000)
        lines = panel.get_by_text("last lines:").locator("..")
        playwright_api.expect(lines).to_contain_text("hosts 0-4, 6-255: step 5 loss 0.53", timeout=30_000)
        playwright_api.expect(lines).to_contain_text("host 5: step 5 loss 0.61")
        grouped.screenshot(path=str(SCALE_IMAGES / "grouped-lines-256.png"))

        scale = cells.nth(4)
        output = scale.locator(".jp-OutputArea")
        _wait_for_header(output, "RUNNING", 120)
        scale.scroll_into_view_if_needed()
        panel = scale.locator(".widget-vbox").first
        playwright_api.expect(panel.locator(".kn-grid i.kn-quiet")).to_have_count(3, timeout=60_000)
        differing = panel.get_by_text("hosts that differ:", exact=False).first
        playwright_api.expect(differing).to_contain_text("3 quiet, 1 still running after 252 of 256 ended",
                                                         timeout=10_000)
        assert panel.locator(".kn-grid i").count() == 256
        assert panel.locator(".kn-grid i.kn-succeeded").count() == 252
        assert "hosts 0-76, 78-99, 103-255: step 10 loss 0.53" in panel.inner_text()
        scale.screenshot(path=str(SCALE_IMAGES / "panel-256-quiet.png"))

        _wait_for_header(output, "FAILED", 120)
        playwright_api.expect(panel.locator(".kn-grid i.kn-failed")).to_have_count(1, timeout=30_000)
        assert panel.locator(".kn-grid i.kn-failed").get_attribute("title") == "host 77 · failed · in the cell"
        playwright_api.expect(panel.locator(".kn-grid i.kn-quiet")).to_have_count(0, timeout=30_000)
        assert panel.locator(".kn-grid i").count() == 256
        assert "host 77: ValueError at In[" in panel.inner_text()
        news = page.get_by_role("button", name="No", exact=True)
        if news.count():
            news.first.click()
            page.get_by_text("Would you like to get notified").wait_for(state="hidden", timeout=10_000)
        scale.scroll_into_view_if_needed()
        scale.screenshot(path=str(SCALE_IMAGES / "panel-256-failed.png"))
