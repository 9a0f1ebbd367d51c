// The collection's site: its figures and its text outputs on any screen, and its search.

// Figures fit the column; a click opens one at its full size in a dialog over the page, which
// scrolls both ways where the figure is larger than the screen and closes with Escape, a click
// or its button. Each figure is a link to its PNG: with a modifier key (a new tab), the PNG
// alone. Where a figure is shown under READABLE_SCALE of its size, below which its smallest
// text (9 pt drawn at 100 dpi) is under about 8 px tall, a line under it says it can be
// enlarged (site.css).
const READABLE_SCALE = 0.65;
const FIGURES = "article.bd-article img:not([alt='Open In Colab'])";

function figureDialog() {
  let dialog = document.querySelector("dialog.figure-dialog");
  if (dialog) return dialog;
  dialog = document.createElement("dialog");
  dialog.className = "figure-dialog";
  dialog.setAttribute("aria-label", "The figure at its full size");
  const close = document.createElement("button");
  close.type = "button";
  close.textContent = "\u00d7";
  close.setAttribute("aria-label", "Close");
  const body = document.createElement("div");
  body.className = "figure-dialog-body";
  body.appendChild(document.createElement("img"));
  const hint = document.createElement("p");
  hint.className = "figure-dialog-hint";
  dialog.append(close, body, hint);
  dialog.addEventListener("click", () => dialog.close());
  document.body.appendChild(dialog);
  return dialog;
}

function enlarge(img) {
  const dialog = figureDialog();
  const full = dialog.querySelector("img");
  full.src = img.currentSrc || img.src;
  full.alt = img.alt;
  dialog.showModal();
  const body = dialog.querySelector(".figure-dialog-body");
  body.scrollTo(0, 0);
  const larger = img.naturalWidth > body.clientWidth || img.naturalHeight > body.clientHeight;
  dialog.querySelector(".figure-dialog-hint").textContent =
    `${larger ? "Drag to see all of it; " : ""}tap, click or Escape to close`;
}

document.addEventListener("DOMContentLoaded", () => {
  const shrunk = new ResizeObserver((entries) => entries.forEach(({target}) => {
    const shown = target.getBoundingClientRect().width;
    target.closest("a").classList.toggle(
      "shrunk", shown > 0 && shown < target.naturalWidth * READABLE_SCALE);
  }));
  document.querySelectorAll(FIGURES).forEach((img) => {
    let link = img.closest("a");
    if (link && link.href !== img.src) return;  // a link elsewhere: left as it is
    if (!link) {
      link = document.createElement("a");
      link.href = img.getAttribute("src");
      img.replaceWith(link);
      link.appendChild(img);
    }
    link.classList.add("figure-link");
    link.title = "The figure at its full size";
    link.addEventListener("click", (event) => {
      if (event.button || event.ctrlKey || event.metaKey || event.shiftKey || event.altKey) return;
      event.preventDefault();
      enlarge(img);
    });
    shrunk.observe(img);
  });
});

// A text output wider than its box (a table: its rows never wrap) scrolls sideways in it; while
// there is more to its right, its box is marked and site.css fades its right edge.
function markMore(pre) {
  const more = pre.scrollWidth - pre.clientWidth - pre.scrollLeft > 1;
  pre.parentElement.classList.toggle("more-to-the-right", more);
}

document.addEventListener("DOMContentLoaded", () => {
  const outputs = document.querySelectorAll("div.cell_output pre");
  const resized = new ResizeObserver((entries) => entries.forEach(({target}) => markMore(target)));
  outputs.forEach((pre) => {
    resized.observe(pre);
    pre.addEventListener("scroll", () => markMore(pre), {passive: true});
  });
  window.addEventListener("load", () => outputs.forEach(markMore));
});

// Sphinx's search cuts each result's summary out of the page's whole <main>, which here holds
// the header's buttons ("Settings Light Dark") and the page's contents, and links to the page
// only. The summary comes from the article instead: from the first section (with a heading of
// its own) that holds the words, named and linked under the page's link.
function firstSection(article, keywords) {
  const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const text = node.textContent.toLowerCase();
    if (!keywords.some((k) => text.includes(k))) continue;
    const section = node.parentElement.closest("section[id]");
    const heading = section && section.querySelector(":scope > h2, :scope > h3, :scope > h4");
    if (heading) return {section, heading};
  }
  return null;
}

function articleSummary(htmlText, searchTerms, anchor) {
  const keywords = [...searchTerms].map((k) => k.toLowerCase());  // a Set, in Sphinx 9
  const page = new DOMParser().parseFromString(htmlText, "text/html");
  page.querySelectorAll(".headerlink, script, style").forEach((el) => el.remove());
  const article = page.querySelector("article.bd-article");
  if (!article) return null;
  const found = anchor ? null : firstSection(article, keywords);
  const scope = found?.section || (anchor && article.querySelector(anchor)) || article;
  const text = scope.textContent.replace(/\s+/g, " ").trim();
  const lower = text.toLowerCase();
  const at = keywords.map((k) => lower.indexOf(k)).filter((i) => i > -1);
  const start = Math.max(Math.min(...at, text.length) - 120, 0);
  const summary = document.createElement("p");
  summary.classList.add("context");
  summary.textContent = `${start ? "..." : ""}${text.substr(start, 240).trim()}`
    + `${start + 240 < text.length ? "..." : ""}`;
  if (found) {
    // the result's link to its page is in place once Sphinx has added this summary to it
    queueMicrotask(() => {
      const pageLink = summary.closest("li")?.querySelector("a");
      if (!pageLink) return;
      const link = document.createElement("a");
      link.className = "search-section";
      link.href = `${pageLink.href.split(/[?#]/)[0]}#${found.section.id}`;
      link.textContent = found.heading.textContent.trim();
      summary.before(link);
    });
  }
  return summary;
}

document.addEventListener("DOMContentLoaded", () => {
  if (typeof Search !== "undefined") Search.makeSearchSummary = articleSummary;
});
