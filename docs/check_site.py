"""Checks the built documentation site in headless Chromium, as a reader's browser loads it.

    python docs/check_site.py [SITE] [--query lora] [--expect guides/lora/]

SITE is the built site folder (default ``build/site``, mkdocs.yml's ``site_dir``). It is served
on 127.0.0.1 (Material's search needs HTTP, not file://) and driven through Playwright:

- the home page, a guide and an API page each have a title, the navigation and their main
  content, and log no console error (a failed request, an uncaught exception);
- a search for ``--query`` in Material's search box lists results, one of them ``--expect``.

Needs ``pip install -e ".[browser]"`` (Playwright) and a Chromium: ``$CHROMIUM``, else the first of
chromium-headless-shell, headless_shell, chromium, chromium-browser found (Debian:
``apt-get install chromium-headless-shell``); Playwright's own browser download is not used.
Without either, it says which is missing and exits 0, or 1 under CI (``$CI`` set).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Page, Route

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "build" / "site"
SITE_NAME = "nnx_shard"
BROWSERS = ("chromium-headless-shell", "headless_shell", "chromium", "chromium-browser")
# Debian's /usr/bin entries are shell wrappers around these; Playwright drives the binary.
DEBIAN_BINARIES = Path("/usr/lib/chromium")
TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class PageCheck:
    """One page to load: its label, its path under the site root, and its content's own mark."""

    label: str
    path: str
    h1: str
    selector: str


PAGES = (
    PageCheck("home", "", SITE_NAME, "article.md-content__inner p"),
    PageCheck("guide", "guides/fine-tuning/", "Fine-tune", "article.md-content__inner pre"),
    # mkdocstrings renders each documented object in a div.doc-object.
    PageCheck("API page", "api/Trainer/", "Trainer", "article.md-content__inner .doc-object"),
)


@dataclass
class Result:
    """What one check saw: ``problems`` empty means it passed."""

    label: str
    summary: str = ""
    problems: list[str] = field(default_factory=list)


def in_ci() -> bool:
    """Whether this is a CI run: ``$CI`` set to anything but empty, 0 or false."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def find_browser() -> tuple[str | None, str]:
    """The Chromium binary to drive, or None and why none was taken."""
    if env := os.environ.get("CHROMIUM"):
        if os.access(env, os.X_OK):
            return env, f"$CHROMIUM={env}"
        return None, f"$CHROMIUM={env} is not an executable file"
    for name in BROWSERS:
        found = shutil.which(name)
        if found is None:
            continue
        binary = DEBIAN_BINARIES / name
        if _is_script(found) and os.access(binary, os.X_OK):
            return str(binary), f"{binary} (behind {found})"
        return found, found
    for name in BROWSERS:
        if os.access(DEBIAN_BINARIES / name, os.X_OK):
            return str(DEBIAN_BINARIES / name), str(DEBIAN_BINARIES / name)
    return None, (
        f"no Chromium found (set $CHROMIUM, or put one of {', '.join(BROWSERS)} on PATH: "
        "apt-get install -y chromium-headless-shell)"
    )


def _is_script(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"#!"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per file: noise
        pass


@contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serves ``site`` on a free port of 127.0.0.1 for the block; yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


def _watch(page: Page, base: str) -> tuple[list[str], list[str]]:
    """Two lists that fill as the page runs: its console errors and uncaught exceptions, and the
    other sites it asked for.

    Requests off ``base`` are aborted: the check is of this site, offline and repeatable; the
    theme's Google Fonts and the repository's GitHub stars degrade by design without them, so
    their failed loads are listed apart, not counted as errors.
    """
    errors: list[str] = []
    external: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        url = msg.location.get("url", "") if msg.location else ""
        if msg.type != "error":
            return
        if url and not url.startswith(base) and msg.text.startswith("Failed to load resource"):
            return
        errors.append(f"{msg.text} ({url})" if url else msg.text)

    def on_route(route: Route) -> None:
        external.append(route.request.url)
        route.abort()

    page.on("console", on_console)
    page.on("pageerror", lambda exc: errors.append(f"uncaught {exc}"))
    page.route(lambda url: not url.startswith(base), on_route)
    return errors, external


@contextmanager
def _opened(browser: Browser, base: str, result: Result) -> Iterator[Page]:
    """A new page for one check: what goes wrong in it (a timeout, a console error) becomes one
    of ``result``'s problems, not an exception that would stop the other checks."""
    from playwright.sync_api import Error as PlaywrightError

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors, external = _watch(page, base)
    try:
        yield page
    except PlaywrightError as e:
        result.problems.append(f"{type(e).__name__}: {e.message.splitlines()[0]}")
    finally:
        result.problems.extend(f"console error: {e}" for e in errors)
        if external:
            hosts = sorted({urlsplit(u).netloc for u in external})
            blocked = f"{len(external)} off-site requests blocked ({', '.join(hosts)})"
            result.summary = f"{result.summary}; {blocked}" if result.summary else blocked
        page.close()


def check_page(browser: Browser, base: str, spec: PageCheck) -> Result:
    """Loads one page; its title, navigation, main content and console are checked."""
    result = Result(f"{spec.label} (/{spec.path})")
    with _opened(browser, base, result) as page:
        response = page.goto(base + spec.path, wait_until="load", timeout=TIMEOUT_MS)
        if response is None or response.status != 200:
            status = "no response" if response is None else f"HTTP {response.status}"
            result.problems.append(f"{status} for {base + spec.path}")
            return result
        # Material wires its components (search, palette, instant loading) after load.
        page.wait_for_load_state("networkidle", timeout=TIMEOUT_MS)
        title = page.title()
        if SITE_NAME not in title:
            result.problems.append(f"title {title!r} does not name the site ({SITE_NAME!r})")
        nav_links = page.locator("nav.md-nav--primary a.md-nav__link").count()
        if nav_links < 5:
            result.problems.append(
                f"the navigation (nav.md-nav--primary) has {nav_links} links, expected >= 5")
        h1 = page.locator("article.md-content__inner h1")
        # The toc extension's permalink adds a pilcrow to every heading.
        heading = h1.first.inner_text().strip().rstrip("¶") if h1.count() else ""
        if spec.h1.lower() not in heading.lower():
            result.problems.append(
                f"main content's <h1> is {heading!r}, expected it to contain {spec.h1!r}")
        marks = page.locator(spec.selector).count()
        if marks == 0:
            result.problems.append(f"main content has no {spec.selector!r}")
        article = page.locator("article.md-content__inner")
        text = article.first.inner_text() if article.count() else ""
        if len(text) < 200:
            result.problems.append(f"main content is {len(text)} characters, expected >= 200")
        result.summary = (f"title {title!r}, {nav_links} nav links, <h1> {heading!r}, "
                          f"{len(text)} chars of content, {marks} x {spec.selector!r}")
    return result


def check_search(browser: Browser, base: str, query: str, expect: str) -> Result:
    """Types ``query`` into Material's search box; results must appear, one linking ``expect``."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    result = Result(f"search {query!r}")
    with _opened(browser, base, result) as page:
        page.goto(base, wait_until="networkidle", timeout=TIMEOUT_MS)
        box = page.locator("input[data-md-component='search-query']")
        if box.count() == 0:
            result.problems.append("the home page has no search box (search-query input)")
            return result
        try:
            box.wait_for(state="visible", timeout=5_000)
        except PlaywrightTimeout:
            result.problems.append("the search box is not visible: Material's JavaScript did "
                                   "not set it up (see the console errors)")
            return result
        box.click()
        # Keystrokes, not fill(): Material searches on keyboard events. The index loads in a
        # web worker; the header reads "N matching documents" or "No matching documents" once
        # the query has run, before that "Initializing search" or "Type to start searching".
        box.press_sequentially(query, delay=50)
        header = page.locator(".md-search-result__meta")
        try:
            header.filter(has_text=re.compile("matching document", re.I)).wait_for(
                timeout=TIMEOUT_MS)
        except PlaywrightTimeout:
            said = header.first.inner_text().strip() if header.count() else "nothing"
            result.problems.append(f"the search for {query!r} did not finish within "
                                   f"{TIMEOUT_MS // 1000} s (the results header says {said!r})")
            return result
        said = header.first.inner_text().strip()
        hrefs = [(h or "").removeprefix(base) for h in page.locator(
            ".md-search-result__item > a").evaluate_all(
            "links => links.map(a => a.getAttribute('href'))")]
        titles = [t.strip() for t in page.locator(
            ".md-search-result__item > a h1").all_inner_texts()]
        if not hrefs:
            result.problems.append(f"no search results for {query!r} (header: {said!r})")
        elif not any(expect in h for h in hrefs):
            result.problems.append(f"no result links to {expect!r}; results: {hrefs[:8]}")
        result.summary = f"{said!r}; first results: {titles[:4]}"
    return result


def run_checks(site: Path, browser_path: str, query: str, expect: str) -> list[Result]:
    """Serves ``site`` and runs every check in one Chromium; returns their results."""
    from playwright.sync_api import sync_playwright

    with serve(site) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True)
        try:
            results = [check_page(browser, base, spec) for spec in PAGES]
            results.append(check_search(browser, base, query, expect))
        finally:
            browser.close()
    return results


def skip_or_fail(reason: str) -> int:
    """Exit status for a check that cannot run: a failure under CI, else a skip (also
    under CI when ``$CHECK_SITE_OPTIONAL`` is set: the CI machine could not install a
    browser, which ``.ci/docs`` says above)."""
    if in_ci() and not os.environ.get("CHECK_SITE_OPTIONAL"):
        print(f"check_site: FAILED: {reason} (CI is set: the browser check is required)")
        return 1
    print(f"check_site: skipped: {reason}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("site", nargs="?", type=Path, default=SITE,
                        help="the built site folder (default: build/site)")
    parser.add_argument("--query", default="lora", help="what to type into the search box")
    parser.add_argument("--expect", default="guides/lora/",
                        help="a link one of the search results must have")
    args = parser.parse_args(argv)
    site: Path = args.site
    if not (site / "index.html").is_file():
        print(f"check_site: FAILED: {site} has no index.html: build the site first "
              "(bash .ci/docs)")
        return 1
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return skip_or_fail('Playwright is not installed (pip install -e ".[browser]")')
    browser_path, how = find_browser()
    if browser_path is None:
        return skip_or_fail(how)
    print(f"check_site: {site} in {how}")
    start = time.perf_counter()
    results = run_checks(site, browser_path, args.query, args.expect)
    for r in results:
        print(f"  {'ok  ' if not r.problems else 'FAIL'}  {r.label}: {r.summary}")
        for problem in r.problems:
            print(f"          - {problem}")
    failed = [r.label for r in results if r.problems]
    elapsed = time.perf_counter() - start
    if failed:
        print(f"check_site: FAILED {len(failed)} of {len(results)} checks "
              f"({', '.join(failed)}) in {elapsed:.1f} s")
        return 1
    print(f"check_site: all {len(results)} checks passed in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
