"""What several test modules share: a JSON POST, the SSE framing check, the error-shape check, polling,
and headless Chromium (Debian's, driven directly: selenium-manager never tries to download one)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgpack

# Hiragana, katakana (with the prolonged sound mark) and CJK ideographs (kanji): text that is Japanese.
JA_CHAR = r"[\u3040-\u309f\u30a0-\u30ff\u4e00-\u9fff]"

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def post(server: Any, path: str, body: Any, *, timeout: float = 120, **kw: Any) -> httpx.Response:
    """POST ``body`` as JSON to a server started by ``launch.serve`` (bytes: sent as they are,
    for what ``json.dumps`` would not write)."""
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=timeout, **kw)
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout, **kw)


def sse_events(raw: bytes) -> list[bytes]:
    """Split a stream's bytes into the data of each event, checking the framing: each is ``data: ...\\n\\n``."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), events
    return [e.removeprefix(b"data: ") for e in events]


def assert_error(r: httpx.Response, status: int, type_: str, *words: str) -> dict:
    """``r`` is llama-server's error shape, ``{"error": {"code", "message", "type"}}``, whose message has ``words``."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == status and error["type"] == type_, error
    for word in words:
        assert word in error["message"], error
    return error


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.01) -> float:
    """Poll ``condition`` until it is true; the seconds it took (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, f"still false after {timeout} s"
        time.sleep(interval)
    return time.monotonic() - t0


def chromium(profile: Path, *, window: str = "1200,800", extra: tuple[str, ...] = (), capabilities: dict | None = None):
    """A headless Chromium driven by selenium; ``make browser`` (which ``make test`` runs) installs it."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    assert not missing, (
        f"the browser tests need Debian's Chromium ({', '.join(missing)} not found): "
        "make browser, or apt-get install -y chromium chromium-driver fonts-noto-cjk"
    )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={window}",
        f"--user-data-dir={profile}",
        *extra,
    ):
        options.add_argument(arg)
    for name, value in (capabilities or {}).items():
        options.set_capability(name, value)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


# --- KV events read back as vllm-router reads them (test_kv_events.py, test_kv_routing.py) ---------------------------

STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}
REMOVED_KEYS = {"type", "block_hashes", "medium"}


class RouterView:
    """The blocks a router holds per tier after reading the payloads, with the checks its decoder and index make,
    made strict: a store whose parent it never saw (the router would skip it), a block stored twice in one tier or
    removed while not held (our counts would be wrong) fail the test."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}  # every name ever stored -> the tokens it stands for
        self.held: dict[str | None, set[bytes]] = {None: set(), "CPU": set()}  # by tier: the slots', the prompt cache's
        self.n_events = 0

    def read(self, payload: bytes) -> None:
        ts, events = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and ts >= 0 and len(events) <= 4096
        for event in events:
            self.n_events += 1
            {"BlockStored": self.stored, "BlockRemoved": self.removed, "AllBlocksCleared": self.cleared}[event["type"]](event)

    def stored(self, e: dict) -> None:
        bs = self.block_size
        assert set(e) == STORED_KEYS and e["lora_id"] is None and e["lora_name"] is None and e["block_size"] == bs
        names, tokens, parent = e["block_hashes"], e["token_ids"], e["parent_block_hash"]
        assert names and len(tokens) == len(names) * bs, "complete blocks only"
        assert parent is None or parent in self.prefix_of, "a store under an unknown parent is skipped by the router"
        prefix = () if parent is None else self.prefix_of[parent]
        for i, name in enumerate(names):
            assert isinstance(name, bytes) and len(name) == 32
            prefix = (*prefix, *tokens[i * bs : (i + 1) * bs])
            assert self.prefix_of.setdefault(name, prefix) == prefix, "one name, one prefix"
            assert name not in self.held[e["medium"]], "stored twice in one tier"
            self.held[e["medium"]].add(name)

    def removed(self, e: dict) -> None:
        assert set(e) == REMOVED_KEYS and e["block_hashes"]
        for name in e["block_hashes"]:
            assert name in self.held[e["medium"]], "removed while not held"
            self.held[e["medium"]].remove(name)

    def cleared(self, e: dict) -> None:
        assert set(e) == {"type"}
        for names in self.held.values():
            names.clear()

    def prefixes(self, medium: str | None) -> set[tuple[int, ...]]:
        return {self.prefix_of[name] for name in self.held[medium]}


def block_prefixes(block_size: int, sequences: list[list[int]]) -> set[tuple[int, ...]]:
    """Every complete block of every sequence, as the prefix that ends with it (what ``RouterView.prefixes`` must equal)."""
    return {tuple(tokens[: k * block_size]) for tokens in sequences for k in range(1, len(tokens) // block_size + 1)}
