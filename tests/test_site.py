"""The rendered site, checked in a real browser (headless Chromium, driven by Playwright).

The site is built once per session from the committed outputs (``python tools/nbtool.py site``
does the same into ``_site/``), served on 127.0.0.1, and every page is opened: the landing page,
each notebook's page and the search page. ``check_page`` returns what is wrong with one page, as a
list of problems; the planted-fault test shows that it reports a missing figure, a broken
internal link and a solution shown open.

Needs Debian's ``chromium`` (``apt-get install chromium``) and the ``playwright`` package; no
browser download (``playwright install``) is used. Without them, these tests skip.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import re
import shutil
import threading
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tools import nbtool

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 900}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = nbtool.ROOT / "_site_screenshots"
SCREENSHOT_PAGES = ("index.html", "notebooks/07_prefetching.html")
SITE_JS = nbtool.SITE_CONFIG / "static" / "site.js"
#: the share of its own size below which a figure's text is too small to read (site.js keeps it)
READABLE_SCALE = float(re.search(r"const READABLE_SCALE = ([0-9.]+);",
                                 SITE_JS.read_text(encoding="utf-8")).group(1))
SEARCH_WORD = "pinned"


# ---------------------------------------------------------------------------- what each page shows


@dataclass
class Solution:
    title: str  # the source's first line
    output: str  # the first line of its first text output


@dataclass
class PageSpec:
    path: str  # relative to the site's root
    texts: list[str] = field(default_factory=list)  # visible on the page
    links: list[str] = field(default_factory=list)  # hrefs the page must have (absolute or
    # relative to the site's root)
    solutions: list[Solution] = field(default_factory=list)


def _first_text_line(output) -> str:
    text = output.get("text") or output.get("data", {}).get("text/plain", "")
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def notebook_spec(path: Path, conf: dict) -> PageSpec:
    nb = nbtool.read(path)
    stamp = nb.metadata[nbtool.METADATA_KEY]["provenance"]
    solutions = []
    for cell in nb.cells:
        if nbtool.is_solution_cell(cell):
            outputs = [_first_text_line(o) for o in cell.get("outputs", [])]
            solutions.append(Solution(cell.source.splitlines()[0],
                                      next((o for o in outputs if o), "")))
    return PageSpec(
        nbtool.site_page(path),
        texts=nbtool.headline_texts(nb) + [stamp["gpu"], f"torch {stamp['torch']}",
                                           stamp["date"]],
        links=[nbtool.colab_url(path.name, conf), nbtool.run_url(path.name, conf),
               nbtool.github_url(f"notebooks/{path.name}", conf)],
        solutions=solutions)


@functools.cache
def expected_pages() -> tuple[PageSpec, ...]:
    """The landing page (the fold of every notebook's headline numbers, a link to every page)
    and one page per notebook (its headline numbers and provenance, its badge, its .ipynb, its
    solutions)."""
    conf = nbtool.settings()
    paths = nbtool.notebook_paths()
    notebooks = [notebook_spec(path, conf) for path in paths]
    landing = PageSpec("index.html",
                       texts=["The headline results of the committed runs (answers to the "
                              "notebooks' predictions: open them after you have predicted)"],
                       links=[s.path for s in notebooks]
                       + [nbtool.run_url(p.name, conf) for p in paths])
    return (landing, *notebooks)


# ---------------------------------------------------------------------------- the checker


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)


@functools.cache
def _anchors(file: Path, mtime: float) -> frozenset[str]:
    parser = _Anchors()
    parser.feed(file.read_text(encoding="utf-8"))
    return frozenset(parser.ids)


def _local_file(site: Path, url_path: str) -> Path:
    relative = urllib.parse.unquote(url_path).lstrip("/")
    file = site / relative
    return file / "index.html" if relative == "" or url_path.endswith("/") else file


def link_problems(site: Path, origin: str, hrefs: list[str]) -> list[str]:
    """Internal links whose page or #anchor does not exist in the built site."""
    problems = []
    for href in sorted(set(hrefs)):
        parsed = urllib.parse.urlsplit(href)
        if f"{parsed.scheme}://{parsed.netloc}" != origin:
            continue  # another site (GitHub, Colab): a link, never a request
        file = _local_file(site, parsed.path)
        if not file.is_file():
            problems.append(f"broken link: {href} (no {file.relative_to(site)})")
        elif parsed.fragment and file.suffix == ".html" and urllib.parse.unquote(
                parsed.fragment) not in _anchors(file, file.stat().st_mtime):
            problems.append(f"broken link: {href} (no #{parsed.fragment} on that page)")
    return problems


#: A page's figures: the article's images but the Colab badge.
FIGURES = "article.bd-article img:not([alt='Open In Colab'])"
_IMAGES_JS = """async () => {
  const FIGURES = "__FIGURES__";
  const column = () => {  // the width of the article's content box
    const article = document.querySelector('article.bd-article'), style = getComputedStyle(article);
    return article.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  };
  const images = [...document.images];
  images.forEach(i => { i.loading = 'eager'; });
  await Promise.all(images.map(i => i.complete ? null : new Promise(done => {
    i.addEventListener('load', done); i.addEventListener('error', done);
    setTimeout(done, 5000);
  })));
  return images.map(i => ({src: i.currentSrc || i.src, natural: i.naturalWidth,
                           shown: i.getBoundingClientRect().width,
                           figure: i.matches(FIGURES), alt: i.alt,
                           caption: (i.closest('figure')?.querySelector('figcaption')
                                     ?.innerText || '').trim(),
                           enlarge: i.closest('a[href]')?.href === (i.currentSrc || i.src),
                           ratio: i.height / i.width,
                           natural_ratio: i.naturalHeight / i.naturalWidth,
                           right: i.getBoundingClientRect().right, column: column()}));
}""".replace("__FIGURES__", FIGURES)
#: A block's lines (its text split at its line breaks, blank ones left out), each with the
#: number of line boxes it renders on and how far (px) it reaches past the block's content box,
#: measured with ranges over the text, whatever markup holds it.
_LINES_FN = """(pre) => {
  const nodes = [], walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
  let text = '';
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    nodes.push([node, text.length]);
    text += node.data;
  }
  const at = (offset) => {
    let k = nodes.length - 1;
    while (k > 0 && nodes[k][1] > offset) k--;
    return [nodes[k][0], offset - nodes[k][1]];
  };
  const style = getComputedStyle(pre);
  const edge = pre.getBoundingClientRect().left + pre.clientLeft + pre.clientWidth
    - parseFloat(style.paddingRight);
  const lines = [];
  let start = 0;
  for (const line of text.split('\\n')) {
    if (line.trim()) {
      const range = document.createRange();
      range.setStart(...at(start));
      range.setEnd(...at(start + line.length));
      const rects = [...range.getClientRects()].filter(r => r.width > 0);
      const tops = rects.map(r => r.top).sort((a, b) => a - b);
      lines.push({text: line, boxes: tops.filter((top, i) => !i || top > tops[i - 1] + 2).length,
                  past: Math.max(...rects.map(r => r.right), edge) - edge});
    }
    start += line.length + 1;
  }
  return lines;
}"""
_LAYOUT_JS = """() => {
  const lines = __LINES__;
  const wide = [...document.querySelectorAll('div.highlight pre, div.cell_output pre')]
    .filter(b => b.scrollWidth > b.clientWidth + 1)
    .map(b => ({output: !!b.closest('div.cell_output'), lines: lines(b)}));
  return {page: document.documentElement.scrollWidth, wide: wide};
}""".replace("__LINES__", _LINES_FN)


def figure_problems(image: dict, viewport: dict) -> list[str]:
    """A figure fits the column (scaled down, its aspect kept), is never shown under
    READABLE_SCALE of its size on a wide screen (on a narrower one, where it may be, a link
    enlarges it: site.js opens it at its full size), says in words what it shows (alt text, not
    its file name) and has a caption."""
    problems = []
    name = image["src"].rsplit("/", 1)[-1]
    small = image["shown"] < image["natural"] * READABLE_SCALE - 1
    if small and (viewport["width"] >= VIEWPORT["width"] or not image["enlarge"]):
        problems.append(f"{viewport['width']} px: figure too small to read: {name} shown "
                        f"{image['shown']:.0f} px wide of {image['natural']}"
                        + ("" if image["enlarge"] else ", and nothing enlarges it"))
    if image["shown"] > image["column"] + 1 or image["right"] > viewport["width"]:
        problems.append(f"{viewport['width']} px: figure wider than the column: {name} shown "
                        f"{image['shown']:.0f} px wide, the column is {image['column']:.0f}")
    if image["shown"] and abs(image["ratio"] - image["natural_ratio"]) > 0.02 * image[
            "natural_ratio"]:
        problems.append(f"{viewport['width']} px: figure out of shape: {name}")
    if len(image["alt"].split()) < 4 or image["alt"].endswith(".png"):
        problems.append(f"figure without alt text: {name} (alt '{image['alt']}')")
    if not image["caption"]:
        problems.append(f"figure without a caption: {name}")
    return problems


def _wider_than_the_column(block: dict) -> list[str]:
    """The lines that make a block scroll sideways and should not: of code, its longest line; of
    an output, its lines past the column that are not table rows (a table row never wraps:
    table_problems), or its longest line where no table row is past the column."""
    longest = max((line["text"] for line in block["lines"]), key=len, default="")
    if not block["output"]:
        return [longest]
    past = [line["text"] for line in block["lines"] if line["past"] > 1]
    if not any(nbtool.TABLE_ROW.search(line) for line in past):
        return [longest]
    return [line for line in past if not nbtool.TABLE_ROW.search(line)]


def layout_problems(page, viewport: dict) -> list[str]:
    """No page is wider than the screen; on a wide screen (1400 px) no block of code or output
    scrolls sideways but a table wider than the column (on a phone such a block scrolls in its
    own box)."""
    layout = page.evaluate(_LAYOUT_JS)
    problems = []
    if layout["page"] > viewport["width"]:
        problems.append(f"{viewport['width']} px: the page is {layout['page']} px wide")
    if viewport["width"] >= VIEWPORT["width"]:
        problems += [f"{viewport['width']} px: a block wider than the column: '{line.strip()}'"
                     for block in layout["wide"] for line in _wider_than_the_column(block)]
    return problems


#: Every text output, the folded ones opened: its lines (_LINES_FN), whether it scrolls sideways
#: and whether it shows that it does: a fade at its right edge (site.js and site.css draw it as
#: the ::after of the block's box while there is more to its right).
_TABLES_JS = """() => {
  const lines = __LINES__;
  const fade = (pre) => {
    const style = getComputedStyle(pre.parentElement, '::after');
    return style.content !== 'none' && parseFloat(style.opacity) >= 0.5
      && parseFloat(style.width) >= 16;
  };
  return [...document.querySelectorAll('div.cell_output pre')]
    .filter(pre => pre.getClientRects().length)
    .map(pre => ({lines: lines(pre), scrolls: pre.scrollWidth > pre.clientWidth + 1,
                  sign: fade(pre)}));
}""".replace("__LINES__", _LINES_FN)
#: The first line of each output that still fades at its edge once scrolled to its end.
_FADE_AT_THE_END_JS = """async () => {
  const wide = [...document.querySelectorAll('div.cell_output pre')]
    .filter(pre => pre.getClientRects().length && pre.scrollWidth > pre.clientWidth + 1);
  wide.forEach(pre => { pre.scrollLeft = pre.scrollWidth; });
  await new Promise(done => setTimeout(done, 150));
  const left = wide.filter(pre => parseFloat(getComputedStyle(pre.parentElement, '::after')
    .opacity) >= 0.5).map(pre => pre.textContent.trim().split('\\n')[0]);
  wide.forEach(pre => { pre.scrollLeft = 0; });
  return left;
}"""


def table_problems(browser, origin: str, path: str, viewport: dict) -> list[str]:
    """What is wrong with a page's text outputs at one screen width, its folded ones opened: a
    table row (nbtool.TABLE_ROW) that renders on more than one line box, a block wider than its
    box with no sign that it scrolls sideways (a fade at its edge, gone once scrolled to the
    end), a page wider than the screen."""
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    width, problems = viewport["width"], []
    try:
        page.goto(f"{origin}/{path}", wait_until="load")
        page.evaluate("() => document.querySelectorAll('details').forEach(d => { d.open = true; })")
        page.wait_for_timeout(200)
        for block in page.evaluate(_TABLES_JS):
            problems += [f"{width} px: a table row wraps onto {line['boxes']} lines: "
                         f"'{line['text'].strip()}'" for line in block["lines"]
                         if nbtool.TABLE_ROW.search(line["text"]) and line["boxes"] > 1]
            if block["scrolls"] and not block["sign"]:
                problems.append(f"{width} px: an output scrolls sideways with no sign that it "
                                f"does: '{block['lines'][0]['text'].strip()}'")
        problems += [f"{width} px: an output still fades at its edge once scrolled to its end: "
                     f"'{line}'" for line in page.evaluate(_FADE_AT_THE_END_JS)]
        wide = page.evaluate("() => document.documentElement.scrollWidth")
        if wide > width:
            problems.append(f"{width} px: the page is {wide} px wide")
    finally:
        context.close()
    return problems


_FIGURE_SOURCES_JS = f"""() => [...document.querySelectorAll("{FIGURES}")]
  .map(i => [i.currentSrc || i.src, i.naturalWidth])"""
_OPEN_DIALOG_IMAGE_JS = """async () => {
  const image = document.querySelector('dialog[open] img');
  if (!image) return null;
  if (!image.complete) await new Promise(done => {
    image.addEventListener('load', done); image.addEventListener('error', done);
  });
  return {src: image.currentSrc || image.src, shown: image.getBoundingClientRect().width,
          page: document.documentElement.scrollWidth};
}"""


def enlarge_problems(browser, origin: str, path: str, viewport: dict) -> list[str]:
    """Each figure of a page, clicked, opens at its full size (its own PNG, as wide as its
    pixels) over the page, without leaving it or widening it, and closes with Escape."""
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    width, problems = viewport["width"], []
    try:
        url = f"{origin}/{path}"
        page.goto(url, wait_until="load")
        page.evaluate(_IMAGES_JS)  # every image loaded
        images = page.locator(FIGURES)
        for index, (src, natural) in enumerate(page.evaluate(_FIGURE_SOURCES_JS)):
            name = src.rsplit("/", 1)[-1]
            images.nth(index).click()
            page.wait_for_timeout(100)
            if page.url.split("#")[0] != url:
                problems.append(f"{width} px: clicking {name} left the page for {page.url}")
                break
            shown = page.evaluate(_OPEN_DIALOG_IMAGE_JS)
            if shown is None:
                problems.append(f"{width} px: clicking {name} enlarged nothing")
                continue
            if shown["src"] != src or shown["shown"] < natural - 1:
                problems.append(f"{width} px: clicking {name} showed {shown['src']} "
                                f"{shown['shown']:.0f} px wide, not its {natural} px")
            if shown["page"] > width:
                problems.append(f"{width} px: {name} enlarged widens the page to "
                                f"{shown['page']} px")
            page.keyboard.press("Escape")
            page.wait_for_timeout(50)
            if page.locator("dialog[open]").count():
                problems.append(f"{width} px: {name} enlarged does not close with Escape")
                break
    finally:
        context.close()
    return problems


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _visible_text(locator) -> str:
    """The text a reader sees (innerText leaves out what is folded or hidden)."""
    return _squeezed(locator.inner_text())


def solution_problems(page, solutions: list[Solution]) -> list[str]:
    """Each solution (source and outputs) is folded until its summary is clicked, then shown."""
    cells = page.locator(".cell.tag_solution")
    if cells.count() != len(solutions):
        return [f"solutions: {cells.count()} on the page, the notebook has {len(solutions)}"]
    problems = []
    for index, solution in enumerate(solutions):
        cell = cells.nth(index)
        before = _visible_text(cell)
        shown = (("source", _squeezed(solution.title)), ("output", _squeezed(solution.output)))
        for what, text in shown:
            if text in before:
                problems.append(f"solution {index + 1} visible before click: its {what} "
                                f"'{text}'")
        summary = cell.locator("summary")
        if summary.count() != 1 or not summary.is_visible():
            problems.append(f"solution {index + 1}: no summary to click")
            continue
        summary.click()
        after = _visible_text(cell)
        for what, text in shown:
            if text not in after:
                problems.append(f"solution {index + 1} not shown after click: its {what} "
                                f"'{text}'")
    return problems


def check_page(browser, site: Path, origin: str, spec: PageSpec,
               screenshot: Path | None = None, viewport: dict = VIEWPORT) -> list[str]:
    """What is wrong with one page of the site at one screen width: console errors, requests to
    another host or failing, images not loaded, figures too small or without alt text or
    caption, a page wider than the screen or code wider than the column, broken internal
    links, expected text or links missing, solutions not folded. An empty list: nothing."""
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    problems: list[str] = []

    def on_request(route):
        url = route.request.url
        if url.startswith((origin + "/", "data:", "blob:")):
            route.continue_()
        else:
            problems.append(f"request leaving the site: {url}")
            route.abort()

    context.route("**/*", on_request)
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: r.url.startswith(origin) and problems.append(
        f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and problems.append(
        f"HTTP {r.status}: {r.url}"))
    try:
        page.goto(f"{origin}/{spec.path}", wait_until="load")
        for image in page.evaluate(_IMAGES_JS):
            if image["natural"] == 0:
                problems.append(f"image not loaded: {image['src']}")
            elif image["figure"]:
                problems += figure_problems(image, viewport)
            elif image["alt"] == "Open In Colab" and image["shown"] < image["natural"] - 1:
                problems.append(f"badge squeezed: {image['shown']:.0f} px wide")
        problems += layout_problems(page, viewport)
        hrefs = page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)")
        problems += link_problems(site, origin, hrefs)
        for link in spec.links:
            wanted = link if "://" in link else f"{origin}/{link}"
            if wanted not in hrefs:
                problems.append(f"missing link: {wanted}")
        text = _visible_text(page.locator("main"))
        problems += [f"not shown: '{t}'" for t in spec.texts if _squeezed(t) not in text]
        if spec.solutions and not page.locator(".cell_input .highlight span.k").count():
            problems.append("code not highlighted (no keyword marked in any code cell)")
        nav = [h.split("#")[0] for h in page.eval_on_selector_all(
            "nav.bd-docs-nav a.reference.internal", "links => links.map(a => a.href)")]
        order = [f"{origin}/{p.path}" for p in expected_pages()[1:]]
        if [h for h in nav if h in order] != order:
            problems.append("navigation: the notebooks are not listed in order")
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        problems += solution_problems(page, spec.solutions)
    finally:
        context.close()
    return problems


#: words of the page's chrome (the header's theme menu, the contents' title) that a search
#: result's summary, cut from the article, never shows
CHROME_WORDS = ("Settings", "Light Dark", "Contents")
_RESULTS_JS = """() => [...document.querySelectorAll('#search-results ul.search li')].map(li => ({
  page: li.querySelector('a').href.split(/[?#]/)[0],
  sections: [...li.querySelectorAll('a.search-section')].map(a => a.href),
  summary: li.querySelector('p.context')?.textContent || ''}))"""


def search_problems(browser, site: Path, origin: str, word: str,
                    pages: list[str]) -> list[str]:
    """The site's search (offline, its own index) finds ``word`` on some of ``pages``; each
    result's summary shows the page's text, not its chrome, and most results link the section
    the word is in (an anchor that exists, in a section that holds the word)."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(f"{origin}/search.html?q={word}", wait_until="load")
        page.wait_for_selector("#search-results ul.search li a", timeout=15000)
        page.wait_for_function("() => !document.querySelector('#search-results ul.search li:not("
                               ":has(p.context))')", timeout=15000)
        results = page.evaluate(_RESULTS_JS)
    except Exception as error:  # reported as a problem
        return [f"search for '{word}': no results ({type(error).__name__})", *errors]
    finally:
        context.close()
    problems = [f"console error: {e}" for e in errors]
    if not any(r["page"] == f"{origin}/{p}" for r in results for p in pages):
        problems.append(f"search for '{word}' found none of the notebooks: {results}")
    for result in results:
        problems += [f"search summary shows the page's chrome ('{w}'): {result['page']}"
                     for w in CHROME_WORDS if w in result["summary"]]
    sections = [href for r in results for href in r["sections"]]
    if len(sections) < len(results) / 2:
        problems.append(f"search: {len(sections)} of {len(results)} results link a section")
    problems += link_problems(site, origin, sections)
    return problems


# ---------------------------------------------------------------------------- fixtures


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


NAVIGATION = {"primary": "#pst-primary-sidebar-modal", "secondary": "#pst-secondary-sidebar-modal"}


def navigation_problems(browser, url: str, viewport: dict) -> list[str]:
    """What is wrong with the sidebar buttons a reader sees on ``url``: on a phone (under the
    themes' 992 px) the menu (primary) and the page's contents (secondary) must each open as a
    dialog with links in it; wider, the menu button must fold the menu."""
    page = browser.new_page(viewport=viewport)
    problems = []
    try:
        page.goto(url)
        phone = viewport["width"] < 992
        for side, dialog in NAVIGATION.items():
            shown = [b for b in page.locator(f".{side}-toggle").all() if b.is_visible()]
            if not shown:
                if phone or side == "primary":
                    problems.append(f"{viewport['width']} px: no {side} sidebar button shown")
                continue
            folded = "() => document.querySelector('#pst-primary-sidebar')" \
                     ".classList.contains('pst-sidebar-hidden')"
            before = page.evaluate(folded)
            shown[0].click()
            page.wait_for_timeout(200)
            if phone:
                opened = page.evaluate(f"() => document.querySelector('{dialog}').open")
                links = page.locator(f"{dialog} a").count()
                if not opened or not links:
                    problems.append(f"{viewport['width']} px: the {side} button opened no "
                                    f"dialog with links (open: {opened}, links: {links})")
                page.keyboard.press("Escape")
            elif side == "primary" and page.evaluate(folded) == before:
                problems.append(f"{viewport['width']} px: the menu button did not fold the menu")
    finally:
        page.close()
    return problems


@contextmanager
def serve(folder: Path):
    """Serve ``folder`` on 127.0.0.1 (a free port); yields the origin, http://127.0.0.1:PORT."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="the playwright package is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def site(tmp_path_factory, browser) -> Path:
    start = time.perf_counter()
    built = nbtool.build_site(tmp_path_factory.mktemp("site") / "_site")
    print(f"site built in {time.perf_counter() - start:.1f} s")
    return built


@pytest.fixture(scope="session")
def origin(site):
    with serve(site) as address:
        yield address


# ---------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("viewport", [PHONE, VIEWPORT], ids=lambda v: f"{v['width']}px")
@pytest.mark.parametrize("spec", expected_pages(), ids=lambda s: s.path)
def test_page(browser, site, origin, spec, viewport):
    name = f"{spec.path.replace('/', '_').replace('.html', '')}_{viewport['width']}.png"
    shot = SCREENSHOTS / name if spec.path in SCREENSHOT_PAGES else None
    assert check_page(browser, site, origin, spec, shot, viewport) == []


@pytest.mark.parametrize("viewport", [PHONE, VIEWPORT], ids=lambda v: f"{v['width']}px")
def test_the_one_page_sheet_is_a_page_of_the_site(browser, site, origin, viewport):
    # The room's sheet: its drawing and every rule, linked from the landing page.
    rules = [r["rule"] for p in nbtool.notebook_paths()
             for r in nbtool.read(p).metadata[nbtool.METADATA_KEY].get("rules", [])]
    spec = PageSpec("SHEET.html", texts=rules,
                    links=[s.path for s in expected_pages()[1:]])
    assert check_page(browser, site, origin, spec, viewport=viewport) == []
    page = browser.new_page(viewport=viewport)
    try:
        page.goto(f"{origin}/SHEET.html", wait_until="load")
        drawing = page.locator("main img[src$='sheet_data_path.svg']")
        assert drawing.count() == 1
        size = drawing.evaluate("i => [i.naturalWidth, i.getBoundingClientRect().width, "
                                "i.closest('main').getBoundingClientRect().width]")
        assert size[0] > 0 and size[1] <= size[2] + 1, size
        page.goto(f"{origin}/index.html", wait_until="load")
        assert page.locator("main a[href$='SHEET.html']").count() >= 1
    finally:
        page.close()


def test_search_finds_the_notebooks_and_links_their_sections(browser, site, origin):
    pages = [spec.path for spec in expected_pages()[1:]]
    assert search_problems(browser, site, origin, SEARCH_WORD, pages) == []


def test_the_search_check_fails_with_sphinxs_own_summaries(browser, site, tmp_path):
    """Without site.js, Sphinx cuts summaries from the whole <main> (the header's theme menu
    included) and links pages only: the check says both."""
    faulty = tmp_path / "site"
    shutil.copytree(site, faulty)
    (faulty / "_static" / "site.js").write_text("", encoding="utf-8")
    pages = [spec.path for spec in expected_pages()[1:]]
    with serve(faulty) as address:
        problems = search_problems(browser, faulty, address, SEARCH_WORD, pages)
    assert any("shows the page's chrome" in p for p in problems), problems
    assert any("results link a section" in p for p in problems), problems


SEARCH_CONTROLS = ".search-button-field, .search-button, form.bd-search"


@pytest.mark.parametrize("viewport", [PHONE, VIEWPORT], ids=lambda v: f"{v['width']}px")
@pytest.mark.parametrize("path", ["index.html", "notebooks/00_timing_async_work.html",
                                  "search.html"])
def test_one_search_box(browser, origin, path, viewport):
    page = browser.new_page(viewport=viewport)
    try:
        page.goto(f"{origin}/{path}")
        shown = [c for c in page.locator(SEARCH_CONTROLS).all() if c.is_visible()]
        assert len(shown) == 1, [c.evaluate("e => e.outerHTML.slice(0, 120)") for c in shown]
    finally:
        page.close()


@pytest.mark.parametrize("spec", expected_pages()[1:], ids=lambda s: s.path)
def test_each_notebook_page_offers_the_committed_notebook_to_download_and_to_open_on_colab(
        browser, site, origin, spec):
    name = Path(spec.path).with_suffix(".ipynb").name
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(f"{origin}/{spec.path}")
        header = page.locator(".bd-header-article")
        # Colab opens the copy without outputs (the run branch), as the page's badge does
        launch = header.locator(f'a[href="{nbtool.run_url(name, nbtool.settings())}"]')
        answered = header.locator(f'a[href="{nbtool.colab_url(name, nbtool.settings())}"]')
        download = header.locator(f'a[href*="_sources/"][href$="/{name}"]')
        assert launch.count() == 1 and download.count() == 1 and answered.count() == 0
        served = page.request.get(download.get_attribute("href", timeout=5000)
                                  if "://" in download.get_attribute("href")
                                  else urllib.parse.urljoin(page.url, download.get_attribute(
                                      "href")))
        assert served.ok and served.body() == (nbtool.NOTEBOOKS / name).read_bytes()
    finally:
        page.close()


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_the_colours_follow_the_system_and_figures_keep_a_light_ground(browser, origin, scheme):
    """The figures are drawn on white: in dark mode the theme frames them on a light ground
    (and dims them a little) instead of leaving white rectangles on black."""
    context = browser.new_context(viewport=VIEWPORT, color_scheme=scheme)
    page = context.new_page()
    try:
        page.goto(f"{origin}/notebooks/00_timing_async_work.html")
        assert page.evaluate("() => document.documentElement.dataset.theme") == scheme
        grounds = page.eval_on_selector_all(
            "div.cell_output img", "images => images.map(i => getComputedStyle(i)"
            ".backgroundColor.match(/\\d+/g).slice(0, 3).map(Number))")
        if scheme == "dark":
            assert grounds and all(min(rgb) >= 180 for rgb in grounds), grounds
    finally:
        context.close()


#: what a page may load besides itself and its figures (Font Awesome's script alone was 1.56 MB)
PAGE_ASSETS_BYTES = 1_200_000


@pytest.mark.parametrize("path", ["index.html", "notebooks/07_prefetching.html"])
def test_a_page_loads_little_besides_its_figures(browser, origin, path):
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(f"{origin}/{path}", wait_until="load")
        page.wait_for_timeout(500)
        loaded = page.evaluate("() => performance.getEntriesByType('resource')"
                               ".filter(r => !r.name.includes('/_images/'))"
                               ".map(r => [r.name, r.encodedBodySize])")
        assert sum(size for _, size in loaded) <= PAGE_ASSETS_BYTES, sorted(
            loaded, key=lambda r: -r[1])[:5]
        assert not any("fontawesome.js" in name for name, _ in loaded)
    finally:
        page.close()


def test_the_checker_reports_planted_faults(browser, site, tmp_path):
    """A missing figure, a broken internal link and a solution shown open each make the check
    fail, and name what is wrong."""
    faulty = tmp_path / "site"
    shutil.copytree(site, faulty)
    pages = {spec.path: spec for spec in expected_pages()}
    first, second = (spec.path for spec in list(pages.values())[1:3])

    # a figure missing: the first output image of the first notebook's page
    page = (faulty / first).read_text(encoding="utf-8")
    figure = re.search(r'<div class="cell_output[^"]*">.*?<img[^>]*src="([^"]+)"', page,
                       re.S).group(1)
    (faulty / first).parent.joinpath(figure).resolve().unlink()
    # a broken internal link: the landing page's link to the second notebook; and an anchor
    # that its target page lacks
    landing = faulty / "index.html"
    broken = second.replace(".html", "_gone.html")
    text = landing.read_text(encoding="utf-8").replace(f'href="{second}"', f'href="{broken}"', 1)
    landing.write_text(text.replace('href="#', 'href="#gone-', 1), encoding="utf-8")
    # a solution shown open: the second notebook's first one
    path = faulty / second
    text = path.read_text(encoding="utf-8")
    opened = re.sub(r'(<div class="cell tag_solution[^"]*">\s*<details)', r"\1 open", text,
                    count=1)
    assert opened != text
    path.write_text(opened, encoding="utf-8")

    with serve(faulty) as address:
        found = {p: check_page(browser, faulty, address, pages[p])
                 for p in (first, "index.html", second)}
    assert any(p.startswith("image not loaded") and figure.split("/")[-1] in p
               for p in found[first]), found[first]
    assert any(p.startswith("broken link") and broken in p for p in found["index.html"]), \
        found["index.html"]
    assert any(p.startswith("broken link") and "(no #gone-" in p for p in found["index.html"]), \
        found["index.html"]
    assert any(p.startswith("solution 1 visible before click") for p in found[second]), \
        found[second]


@pytest.mark.parametrize("viewport", [PHONE, VIEWPORT], ids=lambda v: f"{v['width']}px")
@pytest.mark.parametrize("path", ["index.html", "notebooks/00_timing_async_work.html"])
def test_the_menu_and_the_contents_open(browser, origin, path, viewport):
    assert navigation_problems(browser, f"{origin}/{path}", viewport) == []


def test_the_navigation_check_fails_when_the_themes_bind_hidden_buttons(browser, site,
                                                                        tmp_path):
    """The themes' scripts bind the sidebars to the first ".primary-toggle" and
    ".secondary-toggle" of a page. With pydata-sphinx-theme's navbar shown (it held a second
    search box), those were its hidden buttons: the buttons readers saw did nothing, and on a
    phone the site had no menu. Planting such hidden buttons first makes the check say so."""
    faulty = tmp_path / "site"
    shutil.copytree(site, faulty)
    path = faulty / "notebooks" / "00_timing_async_work.html"
    hidden = ('<button class="sidebar-toggle primary-toggle" style="display: none"></button>'
              '<button class="sidebar-toggle secondary-toggle" style="display: none"></button>')
    path.write_text(re.sub(r"(<body[^>]*>)", rf"\1{hidden}", path.read_text(encoding="utf-8"),
                           count=1), encoding="utf-8")
    with serve(faulty) as address:
        url = f"{address}/notebooks/00_timing_async_work.html"
        phone, desktop = (navigation_problems(browser, url, v) for v in (PHONE, VIEWPORT))
    assert any("primary button opened no dialog" in p for p in phone), phone
    assert any("secondary button opened no dialog" in p for p in phone), phone
    assert any("did not fold the menu" in p for p in desktop), desktop


@pytest.mark.parametrize("spec", expected_pages()[1:], ids=lambda s: s.path)
def test_the_answers_stay_folded_until_clicked(browser, origin, spec):
    nb = nbtool.read(nbtool.NOTEBOOKS / Path(spec.path).with_suffix(".ipynb").name)
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(f"{origin}/{spec.path}")
        answers = page.locator("details.answer")  # the exercise's and each short answer
        assert answers.count() == len(nbtool.answer_cells(nb)) + sum(
            nbtool.is_short_answer(c) for c in nb.cells)
        for index in range(answers.count()):
            answer = answers.nth(index)
            text = answer.locator("p").first
            assert not text.is_visible(), f"answer {index + 1} visible before click"
            answer.locator("summary").click()
            assert text.is_visible(), f"answer {index + 1} not shown after click"
    finally:
        page.close()


@pytest.mark.parametrize("path", ["index.html", "notebooks/00_timing_async_work.html"])
def test_every_block_of_code_has_a_copy_button_and_no_output_has_one(browser, origin, path):
    page = browser.new_page(viewport=VIEWPORT)
    try:
        page.goto(f"{origin}/{path}")
        code = page.locator("div.highlight pre").count() \
            - page.locator("div.cell_output div.highlight pre").count()
        assert code > 0
        assert page.locator("button.copybtn").count() == code
        assert page.locator("div.cell_output button.copybtn").count() == 0
    finally:
        page.close()


def test_the_layout_check_reports_planted_faults(browser, site, tmp_path):
    """A figure without alt text or caption, a word that widens the page on a phone, a line of
    code wider than the column at 1400 px, and figures shrunk on a phone with nothing to
    enlarge them (site.js gone) each make the check fail, and name what is wrong."""
    faulty = tmp_path / "site"
    shutil.copytree(site, faulty)
    spec = expected_pages()[4]
    path = faulty / spec.path
    text = path.read_text(encoding="utf-8")
    text = re.sub(r'(<figure[^>]*>\s*<img alt=")[^"]*"', r'\1"', text, count=1)
    text = re.sub(r"<figcaption>.*?</figcaption>", "", text, count=1, flags=re.S)
    long_word = "x" * 60  # about 500 px: wider than a phone, not than the desktop column
    text = re.sub(r"(<article[^>]*>)", rf'\1<p style="white-space: nowrap">{long_word}</p>',
                  text, count=1)
    text = re.sub(r'(<div class="cell_input[^"]*">\s*<div class="highlight[^"]*">'
                  r'<div class="highlight"><pre>)', rf"\1{'y' * 130}\n", text, count=1)
    path.write_text(text, encoding="utf-8")
    (faulty / "_static" / "site.js").write_text("", encoding="utf-8")
    with serve(faulty) as address:
        phone, desktop = (check_page(browser, faulty, address, spec, viewport=v)
                          for v in (PHONE, VIEWPORT))
    assert any(p.startswith("figure without alt text") for p in desktop), desktop
    assert any(p.startswith("figure without a caption") for p in desktop), desktop
    assert any(p.startswith("390 px: the page is") for p in phone), phone
    assert not any("the page is" in p for p in desktop), desktop
    assert any("a block wider than the column" in p and "y" * 130 in p for p in desktop), desktop
    assert any(p.startswith("390 px: figure too small to read") for p in phone), phone
    assert not any("too small to read" in p for p in desktop), desktop


@pytest.mark.parametrize("viewport", [PHONE, VIEWPORT], ids=lambda v: f"{v['width']}px")
@pytest.mark.parametrize("spec", expected_pages()[1:], ids=lambda s: s.path)
def test_no_table_row_wraps_and_a_wide_table_scrolls_in_its_own_box(browser, origin, spec,
                                                                     viewport):
    assert table_problems(browser, origin, spec.path, viewport) == []


@pytest.mark.parametrize("viewport", [PHONE, VIEWPORT], ids=lambda v: f"{v['width']}px")
@pytest.mark.parametrize("spec", expected_pages(), ids=lambda s: s.path)
def test_each_figure_opens_at_its_full_size_when_clicked(browser, origin, spec, viewport):
    assert enlarge_problems(browser, origin, spec.path, viewport) == []


def _landing_figures() -> dict[str, str]:
    """The README's figures, each with the caption of the notebook that draws it."""
    captions = {f["name"]: f["caption"] for path in nbtool.notebook_paths()
                for cell in nbtool.read(path).cells for f in nbtool.figure_texts(cell)}
    names = re.findall(r"^!\[[^\]]*\]\(figures/([\w-]+)\.png\)$",
                       nbtool.README.read_text(encoding="utf-8"), re.M)
    return {name: captions[name] for name in names}


def test_the_landing_page_folds_the_headline_results(browser, origin):
    # They answer the predictions: hidden until the reader opens the fold, then all there.
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(f"{origin}/index.html", wait_until="load")
        texts = [t for path in nbtool.notebook_paths()
                 for t in nbtool.headline_texts(nbtool.read(path))]
        fold = page.locator("details", has_text="The headline results of the committed runs")
        assert fold.count() == 1
        shown = _visible_text(page.locator("main"))
        assert [t for t in texts if _squeezed(t) in shown] == []
        fold.locator("summary").click()
        shown = _visible_text(page.locator("main"))
        assert [t for t in texts if _squeezed(t) not in shown] == []
    finally:
        page.close()


@pytest.mark.parametrize("viewport", [PHONE, VIEWPORT], ids=lambda v: f"{v['width']}px")
def test_the_landing_figure_fills_the_column_and_its_caption_says_what_it_shows(
        browser, origin, viewport):
    expected = _landing_figures()
    assert expected
    page = browser.new_page(viewport=viewport)
    try:
        page.goto(f"{origin}/index.html", wait_until="load")
        shown = {image["src"].rsplit("/", 1)[-1].removesuffix(".png"): image
                 for image in page.evaluate(_IMAGES_JS) if image["figure"]}
        for name, caption in expected.items():
            assert name in shown, (name, list(shown))
            assert abs(shown[name]["shown"] - shown[name]["column"]) <= 1, shown[name]
            assert _squeezed(caption) in _squeezed(shown[name]["caption"]), shown[name]
    finally:
        page.close()


def test_the_table_and_figure_checks_report_planted_faults(browser, site, tmp_path):
    """Table rows left to wrap (their marks gone from a page), wide tables with no sign that
    they scroll and figures that nothing enlarges (site.js gone) each make the checks fail."""
    faulty = tmp_path / "site"
    shutil.copytree(site, faulty)
    pages = [spec.path for spec in expected_pages()[1:]]
    unmarked, unfaded = (next(p for p in pages if p.startswith(f"notebooks/{n}_"))
                         for n in ("06", "08"))
    path = faulty / unmarked
    text = path.read_text(encoding="utf-8")
    bare = re.sub(rf'<span class="{nbtool.TABLE_ROW_CLASS}">([^<]*)</span>', r"\1", text)
    assert bare != text
    path.write_text(bare, encoding="utf-8")
    (faulty / "_static" / "site.js").write_text("", encoding="utf-8")
    with serve(faulty) as address:
        wrapped = table_problems(browser, address, unmarked, VIEWPORT)
        unsigned = table_problems(browser, address, unfaded, PHONE)
        small = enlarge_problems(browser, address, unfaded, PHONE)
    assert any(p.startswith("1400 px: a table row wraps") for p in wrapped), wrapped
    assert any(p.startswith("390 px: an output scrolls sideways with no sign") for p in unsigned), \
        unsigned
    assert any(p.startswith("390 px: clicking") and "enlarged nothing" in p for p in small), small
