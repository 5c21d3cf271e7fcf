"""The panel rendered by JupyterLab in headless Chromium, driven by Playwright.

The test starts its own JupyterLab server on a free port, opens a notebook
whose 4-host cell sleeps in steps and then fails on host 3, and watches the
panel go from running to failed. A screenshot lands in build/test-output/.
"""

from __future__ import annotations

import json
import pathlib
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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    notebook = new_notebook(cells=[new_code_cell("%load_ext kinetic_nb"), new_code_cell(CELL)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "panel.ipynb")
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
    yield f"{base}/lab/tree/panel.ipynb?token={token}"
    server.terminate()
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def test_the_panel_goes_live_in_jupyterlab(jupyterlab):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is needed: .ci/run installs Debian's chromium package"
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        try:
            page.goto(jupyterlab)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=60_000)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()

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
            page.get_by_text("host 3 · failed · execute").click()
            traceback = panel.get_by_text("ValueError: host 3 lost its shard").first
            traceback.wait_for(state="visible", timeout=10_000)
            assert "raise ValueError('host 3 lost its shard')" in panel.inner_text()
            assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                has_text="ValueError").count() >= 1
            news = page.get_by_role("button", name="No", exact=True)
            if news.count():
                news.first.click()  # JupyterLab's news prompt would cover the panel
                page.get_by_text("Would you like to get notified").wait_for(state="hidden", timeout=10_000)
            page.screenshot(path=str(OUTPUT / "panel.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(OUTPUT / "panel-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert (OUTPUT / "panel.png").stat().st_size > 10_000
