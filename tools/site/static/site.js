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

// The themes' scripts (sphinx-book-theme 1.4, pydata-sphinx-theme 0.20) bind the sidebar toggles
// to the first ".primary-toggle" and ".secondary-toggle" of a page, a navbar button that
// sphinx-book-theme keeps hidden: the buttons readers see did nothing, and on a phone the site
// had no menu. Their clicks go to the bound buttons, which open the menu and the page's contents
// (under 992 px) or fold the sidebar (wider).
document.addEventListener("DOMContentLoaded", () => {
  ["primary-toggle", "secondary-toggle"].forEach((name) => {
    const bound = document.querySelector(`.${name}`);
    document.querySelectorAll(`.${name}`).forEach((button) => {
      if (button === bound) return;
      button.addEventListener("click", (event) => {
        event.preventDefault();
        bound.click();
      });
    });
  });
});
