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

// An inline SVG chart drawn with fixed width/height attributes (the page calculator's) keeps
// its drawing when course.css narrows it to the column on a phone: give it the viewBox of its
// own size, so it scales instead of being cut.
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll(".bd-article svg[width][height]:not([viewBox])").forEach(function (svg) {
    if (svg.closest("mjx-container")) return;
    var w = parseFloat(svg.getAttribute("width")), h = parseFloat(svg.getAttribute("height"));
    if (!(w > 0 && h > 0) || /%/.test(svg.getAttribute("width"))) return;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.setAttribute("preserveAspectRatio", "xMinYMin meet");
  });
});

// A chart that an ipywidget drew (its starting state, saved with the page) comes back from the
// widget embedder as an <img> without alt text: say what it is.
document.addEventListener("DOMContentLoaded", function () {
  var label = function () {
    document.querySelectorAll(".jupyter-widgets img:not([alt])").forEach(function (img) {
      img.setAttribute("alt", "Chart drawn by the interactive widget above (its starting " +
                       "state; run the notebook to change it)");
    });
  };
  label();
  new MutationObserver(label).observe(document.body, {childList: true, subtree: true});
});
