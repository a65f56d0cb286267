"""Headless Chromium for the browser tests: Debian's chromium (skip where absent, fail on CI)
and an offline page for a report file that records console errors and every request."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def browser_or_skip():
    """playwright's sync API, or a skip (a failure on CI) where Chromium is missing."""
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing on CI; .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    return pytest.importorskip("playwright.sync_api")


@contextlib.contextmanager
def offline_page(sync_api, path: Path, errors: list, requests: list):
    """``path`` opened in a page that may load file: URLs only (anything else is aborted);
    console errors and warnings go to ``errors``, every requested URL to ``requests``."""
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type in (
                "error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))

            def route(r):
                requests.append(r.request.url)
                r.continue_() if r.request.url.startswith("file:") else r.abort()

            page.route("**/*", route)
            page.goto(path.as_uri())
            yield page
        finally:
            browser.close()
