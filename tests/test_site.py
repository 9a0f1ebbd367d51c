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
    """The landing page (every notebook's headline numbers, a link to every page) and one page
    per notebook (its headline numbers and provenance, its badge, its .ipynb, its solutions)."""
    conf = nbtool.settings()
    paths = nbtool.notebook_paths()
    notebooks = [notebook_spec(path, conf) for path in paths]
    landing = PageSpec("index.html",
                       texts=[t for p in paths for t in nbtool.headline_texts(nbtool.read(p))],
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


_IMAGES_JS = """async () => {
  const images = [...document.images];
  images.forEach(i => { i.loading = 'eager'; });
  await Promise.all(images.map(i => i.complete ? null : new Promise(done => {
    i.addEventListener('load', done); i.addEventListener('error', done);
    setTimeout(done, 5000);
  })));
  return images.map(i => ({src: i.currentSrc || i.src, natural: i.naturalWidth,
                           shown: i.getBoundingClientRect().width,
                           figure: !!i.closest('.cell_output'), alt: i.alt,
                           caption: (i.closest('figure')?.querySelector('figcaption')
                                     ?.innerText || '').trim()}));
}"""
_LAYOUT_JS = """() => {
  const wide = [...document.querySelectorAll('div.highlight pre, div.cell_output pre')]
    .filter(b => b.scrollWidth > b.clientWidth + 1)
    .map(b => b.textContent.split('\\n').reduce((a, l) => l.length > a.length ? l : a, ''));
  return {page: document.documentElement.scrollWidth, wide: wide};
}"""


def figure_problems(image: dict, viewport: dict) -> list[str]:
    """A figure is never shown under READABLE_SCALE of its size, says in words what it shows
    (alt text, not its file name) and has a caption."""
    problems = []
    name = image["src"].rsplit("/", 1)[-1]
    if image["shown"] < image["natural"] * READABLE_SCALE - 1:
        problems.append(f"{viewport['width']} px: figure too small to read: {name} shown "
                        f"{image['shown']:.0f} px wide of {image['natural']}")
    if len(image["alt"].split()) < 4 or image["alt"].endswith(".png"):
        problems.append(f"figure without alt text: {name} (alt '{image['alt']}')")
    if not image["caption"]:
        problems.append(f"figure without a caption: {name}")
    return problems


def layout_problems(page, viewport: dict) -> list[str]:
    """No page is wider than the screen; on a wide screen (1400 px) no block of code or output
    scrolls sideways (on a phone such a block scrolls in its own box)."""
    layout = page.evaluate(_LAYOUT_JS)
    problems = []
    if layout["page"] > viewport["width"]:
        problems.append(f"{viewport['width']} px: the page is {layout['page']} px wide")
    if viewport["width"] >= VIEWPORT["width"]:
        problems += [f"{viewport['width']} px: a block wider than the column: '{line.strip()}'"
                     for line in layout["wide"]]
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
        launch = header.locator(f'a[href="{nbtool.colab_url(name, nbtool.settings())}"]')
        download = header.locator(f'a[href*="_sources/"][href$="/{name}"]')
        assert launch.count() == 1 and download.count() == 1
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
    code wider than the column at 1400 px, and figures left to shrink on a phone (site.js
    gone) each make the check fail, and name what is wrong."""
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
