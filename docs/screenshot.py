"""Builds the documentation site and photographs it in headless Chromium.

    python docs/screenshot.py [--no-build] [--out build/docs-screenshots] [PAGE ...]

PAGE is a site path (default: the home page, a guide and an API page). The site is served from
``build/site`` on 127.0.0.1 (as a browser would load it, not from file://) and each page is saved
as a PNG in ``--out``. Needs ``mkdocs`` (``pip install -e ".[docs]"``) and a Chromium
(``apt-get install chromium``); a missing one is named with that command.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "build" / "site"
PAGES = ["", "guides/sharded-init/", "api/Trainer/"]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def build() -> None:
    """``mkdocs build --strict`` from the repository root, the package importable from it."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=ROOT, env=env, check=True)


def browser() -> str:
    """Path of the first Chromium found on PATH."""
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    raise SystemExit(
        f"no Chromium found (looked for {', '.join(BROWSERS)}); install one: "
        "apt-get update && apt-get install -y chromium"
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per file: noise
        pass


def shoot(pages: list[str], out: Path, width: int = 1400, height: int = 1000) -> list[Path]:
    """Serves the built site and saves one PNG per page; returns the PNG paths."""
    if not (SITE / "index.html").exists():
        raise SystemExit(f"{SITE} has no index.html: build the site first (drop --no-build)")
    out.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    chrome = browser()
    shots = []
    try:
        for page in pages:
            name = page.strip("/").replace("/", "_") or "home"
            png = out / f"{name}.png"
            url = f"http://127.0.0.1:{server.server_port}/{page}"
            subprocess.run(
                [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={width},{height}", f"--screenshot={png}", url],
                check=True, capture_output=True, timeout=120,
            )
            shots.append(png)
    finally:
        server.shutdown()
    return shots


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", default=PAGES)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "docs-screenshots")
    parser.add_argument("--no-build", action="store_true")
    args = parser.parse_args(argv)
    if not args.no_build:
        build()
    for png in shoot(args.pages, args.out):
        print(png)


if __name__ == "__main__":
    main()
