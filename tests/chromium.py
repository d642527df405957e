"""Headless Chromium for the browser tests, driven over the Chrome DevTools protocol with
aiohttp (no browser driver to install).

`find_or_install()` finds Debian's chromium, or installs it with apt-get where that can run (as
root: CI's fresh machine); anywhere else it fails, saying how to install it. A missing browser
never skips the test.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

NAMES = ("chromium", "chromium-browser")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)
INSTALL_TIMEOUT_S = 900
START_TIMEOUT_S = 30


def _found() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def find_or_install() -> str:
    """The chromium executable; apt-get installs it first when it is missing and can."""
    if (path := _found()) is not None:
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.fail(
            "the browser tests need Chromium and this machine has none; install it "
            "(Debian: `sudo apt-get install chromium`) and run them again"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S)
        if r.returncode:
            pytest.fail(
                f"`{' '.join(args)}` failed ({r.returncode}); the browser tests need "
                f"Chromium:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
            )
    if (path := _found()) is None:
        pytest.fail("apt-get installed chromium, yet no chromium executable is on PATH")
    return path


class Browser:
    """One headless Chromium and its first tab."""

    def __init__(self, exe: str, profile: Path, width: int = 1280, height: int = 1600) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "DevToolsActivePort").unlink(missing_ok=True)  # a run before this one's
        self.log = open(profile.parent / "chromium.log", "w")
        self.proc = subprocess.Popen(
            [
                exe,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.loop = asyncio.new_event_loop()
        self._ids = 0
        self.errors: list[str] = []  # the pages' uncaught exceptions
        try:
            port = self._port(profile / "DevToolsActivePort")
            self.session, self.ws = self.loop.run_until_complete(self._connect(port))
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _port(self, file: Path) -> int:
        for _ in range(START_TIMEOUT_S * 20):
            if self.proc.poll() is not None:
                break
            if file.exists() and (lines := file.read_text().splitlines()):
                return int(lines[0])
            self.loop.run_until_complete(asyncio.sleep(0.05))
        self.log.flush()
        raise AssertionError("chromium did not start: " + Path(self.log.name).read_text()[-2000:])

    async def _connect(self, port: int) -> tuple[aiohttp.ClientSession, Any]:
        session = aiohttp.ClientSession()
        async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        return session, await session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result. Of the events that come meanwhile, uncaught
        exceptions are kept in `errors`."""
        return self.loop.run_until_complete(self._call(method, params))

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._ids += 1
        await self.ws.send_str(json.dumps({"id": self._ids, "method": method, "params": params}))
        while True:
            reply = json.loads(await asyncio.wait_for(self.ws.receive_str(), 60))
            if reply.get("method") == "Runtime.exceptionThrown":
                details = reply["params"]["exceptionDetails"]
                self.errors.append(
                    details.get("exception", {}).get("description") or details.get("text", "")
                )
            if reply.get("id") == self._ids:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str, timeout: float = 30) -> None:
        """Go to `url` and wait until the page (wherever it redirected) has loaded."""
        self.call("Page.navigate", url=url)
        loaded = "location.href !== 'about:blank' && document.readyState === 'complete'"
        for _ in range(int(timeout * 20)):
            if self.eval(loaded):
                return
            self.loop.run_until_complete(asyncio.sleep(0.05))
        raise AssertionError(f"{url} did not load in {timeout} s")

    def eval(self, expression: str) -> Any:
        """The expression's value in the page (JSON-able)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, scale: float = 1.0) -> None:
        """The whole page as a PNG, its size times `scale`."""
        width, height = self.eval(
            "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
        )
        clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": scale}
        shot = self.call(
            "Page.captureScreenshot", format="png", captureBeyondViewport=True, clip=clip
        )
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        if hasattr(self, "ws"):
            self.loop.run_until_complete(self.ws.close())
            self.loop.run_until_complete(self.session.close())
        self.loop.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
