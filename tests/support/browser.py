"""Headless Chromium for the watch page's tests and benchmark: Debian's package, driven
by Playwright's Python API (which cannot download browsers here, so it is pointed at
the installed one). Whatever is missing is installed from the package registries."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tests.support.apt import apt_install

CHROMIUM = "/usr/bin/chromium"
INSTALL_TIMEOUT_S = 900
TOLERANCE = 48  # yuv420p and limited range move a solid colour by a few levels


def _install_chromium() -> str | None:
    """Install Debian's chromium if it is not there; why not, when that fails."""
    return apt_install(["chromium"], lambda: os.path.exists(CHROMIUM))


def _install_playwright() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "playwright"]
        done = subprocess.run(cmd, capture_output=True, timeout=INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            return f"pip install playwright failed: {done.stderr.decode(errors='replace')[-300:]}"
    return None


def browser_missing() -> str | None:
    """None once Chromium and Playwright are installed; else why they cannot be."""
    return _install_playwright() or _install_chromium()


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (autoplay allowed: the video is muted anyway), open while the
    block runs. A module's tests share one (a launch is a second or two of CPU), each on
    a page of its own (``fresh_page``)."""
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox", "--autoplay-policy=no-user-gesture-required"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def fresh_page(browser: Any) -> Iterator[Any]:
    """A page in a browser context of its own: no cookies, storage or cache of the pages
    before it."""
    context = browser.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()


def shows(pixel: Sequence[int], colour: tuple[int, int, int]) -> bool:
    """Whether a pixel read off a page is the solid ``colour`` a clip was made of."""
    return all(abs(x - y) <= TOLERANCE for x, y in zip(pixel, colour, strict=True))
