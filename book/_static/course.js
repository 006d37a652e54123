// Where the Memory Goes: site tweaks.
// Chapters are MyST Markdown notebooks (.md), which Colab cannot open; sphinx-book-theme
// still adds a Colab launch button to them. Drop that button, keep it on the labs (.ipynb).
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll('a[href^="https://colab.research.google.com/"]').forEach(function (link) {
    if (!/\.md$/.test(link.getAttribute("href"))) return;
    var menu = link.closest(".dropdown-launch-buttons");
    link.closest("li").remove();
    if (menu && menu.querySelectorAll("a").length === 0) menu.remove();
  });
});
