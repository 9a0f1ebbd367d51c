// The collection's site: a figure opens at its full size when clicked, and is never shown smaller
// than READABLE_SCALE of its size, where its smallest text (9 pt drawn at 100 dpi) is still about
// 8 px tall; where the column is narrower (a phone), it scrolls sideways in its own box.
const READABLE_SCALE = 0.65;
document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("div.cell_output img").forEach((img) => {
    const least = () => {
      img.style.minWidth = `${Math.round(img.naturalWidth * READABLE_SCALE)}px`;
    };
    if (img.complete) least(); else img.addEventListener("load", least);
    if (img.closest("a")) return;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.className = "figure-link";
    link.title = "The figure at its full size";
    img.replaceWith(link);
    link.appendChild(img);
  });
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
