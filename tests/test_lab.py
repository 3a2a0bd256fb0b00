"""``make lab``, the first of the two commands: JupyterLab starts and serves the course notebooks."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from llmkit.course.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_make_lab_serves_the_course_notebooks():
    port, token = free_port(), "llmkit-test"
    lab = subprocess.Popen(
        ["make", "-s", "lab", f"LAB_ARGS=--no-browser --port={port} --IdentityProvider.token={token}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        contents, deadline = None, time.monotonic() + 90
        while contents is None and time.monotonic() < deadline:
            assert lab.poll() is None, f"make lab exited with {lab.returncode}:\n{lab.stdout.read()[-3000:]}"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/contents/en", params={"token": token}, timeout=5)
                contents = r.json() if r.status_code == 200 else None
            except httpx.HTTPError:
                time.sleep(0.5)
        assert contents is not None, "JupyterLab did not answer within 90 s"
        names = {item["name"] for item in contents["content"]}
        english = {p.name for p in (ROOT / "notebooks" / "en").glob("*.ipynb")}
        assert names >= english and "00_start_here.ipynb" in names
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
