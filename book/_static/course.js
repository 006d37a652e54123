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

// A display equation a little wider than the column (up to 1/0.8 = 25 % wider) is set in a
// smaller size so that it fits; a wider one keeps its size and scrolls sideways in its own box
// (course.css). Redone when the window's width changes (a phone turned sideways).
(function () {
  var MIN_SCALE = 0.8;
  function fit() {
    document.querySelectorAll(".bd-article mjx-container[display='true']").forEach(function (m) {
      if (m.dataset.wtmgSize === undefined) m.dataset.wtmgSize = m.style.fontSize || "";
      m.style.fontSize = m.dataset.wtmgSize;
      m.classList.remove("wtmg-scrolls");
      if (!(m.clientWidth > 0) || m.scrollWidth <= m.clientWidth + 1) return;
      var scale = (m.clientWidth - 2) / m.scrollWidth;
      if (scale < MIN_SCALE) { m.classList.add("wtmg-scrolls"); return; }
      var base = parseFloat(m.dataset.wtmgSize) || 100;   // MathJax writes e.g. "127.3%"
      m.style.fontSize = (base * scale).toFixed(1) + "%";
    });
  }
  var width = window.innerWidth, timer = null;
  window.addEventListener("resize", function () {
    if (window.innerWidth === width) return;
    width = window.innerWidth;
    clearTimeout(timer);
    timer = setTimeout(fit, 150);
  });
  document.addEventListener("DOMContentLoaded", function () {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) MathJax.startup.promise.then(fit);
  });
})();
