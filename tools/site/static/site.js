// The collection's site: a figure opens at its full size when clicked.
document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("div.cell_output img").forEach((img) => {
    if (img.closest("a")) return;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.title = "The figure at its full size";
    img.replaceWith(link);
    link.appendChild(img);
  });
});
