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

// A display equation wider than the column. One that is a list of formulas separated by commas
// ("m' = ..., l' = ..., O' = ...") is set one formula per line, aligned at their "="; one a
// little wider (up to 1/0.8 = 25 %) is set in a smaller size so that it fits; one still wider
// keeps its size and scrolls sideways in its own box, with the cue below. Redone when the
// window's width changes (a phone turned sideways): a list set on several lines goes back to
// one line where it fits.
(function () {
  var MIN_SCALE = 0.8;

  // Positions of `ch` outside any group: {...}, (...), [...], \left...\right, \begin...\end.
  function topLevel(tex, ch) {
    var depth = 0, found = [];
    for (var i = 0; i < tex.length; i++) {
      var c = tex[i];
      if (c === "\\") {
        var m = /^\\([a-zA-Z]+|.)/.exec(tex.slice(i));
        if (m[1] === "left" || m[1] === "begin") depth++;
        else if (m[1] === "right" || m[1] === "end") depth--;
        i += m[0].length - 1;
      } else if ("{([".indexOf(c) >= 0) depth++;
      else if ("})]".indexOf(c) >= 0) depth--;
      else if (c === ch && depth === 0) found.push(i);
    }
    return depth === 0 ? found : [];
  }

  // The TeX of the list one formula per line, or null if it is not a list of formulas.
  function asLines(tex) {
    if (/\\\\|\\begin\{/.test(tex)) return null;   // already laid out by its author
    var cuts = topLevel(tex, ","), parts = [], start = 0;
    cuts.forEach(function (at) { parts.push(tex.slice(start, at + 1)); start = at + 1; });
    parts.push(tex.slice(start));
    parts = parts.map(function (p) { return p.replace(/^(\s|\\q?quad\b|\\[,;:! ])+/, "").trim(); })
                 .filter(function (p) { return p; });
    if (parts.length < 2) return null;
    var aligned = parts.every(function (p) { return topLevel(p, "=").length > 0; });
    var lines = parts.map(function (p) {
      if (!aligned) return p;
      var at = topLevel(p, "=")[0];
      return p.slice(0, at) + "&" + p.slice(at);
    });
    return "\\begin{" + (aligned ? "aligned" : "gathered") + "}" + lines.join(" \\\\ ") +
           "\\end{" + (aligned ? "aligned" : "gathered") + "}";
  }

  function retypeset(box, tex) {
    MathJax.typesetClear([box]);
    box.textContent = "\\[" + tex + "\\]";
    return MathJax.typesetPromise([box]);
  }

  function tooWide(m) { return m.clientWidth > 0 && m.scrollWidth > m.clientWidth + 1; }

  function fit() {
    var pending = [];
    document.querySelectorAll(".bd-article div.math").forEach(function (box) {
      var m = box.querySelector("mjx-container[display='true']");
      if (!m) return;
      if (box.dataset.wtmgTex === undefined) {
        var item = MathJax.startup.document.getMathItemsWithin(box)[0];
        box.dataset.wtmgTex = item ? item.math : "";
      }
      var tex = box.dataset.wtmgTex;
      if (box.dataset.wtmgLines && box.clientWidth > +box.dataset.wtmgLines) {
        delete box.dataset.wtmgLines;   // wider now: back to one line, then fit again
        pending.push(retypeset(box, tex));
      } else if (!box.dataset.wtmgLines && tooWide(m) && asLines(tex)) {
        box.dataset.wtmgLines = String(box.clientWidth);
        pending.push(retypeset(box, asLines(tex)));
      }
    });
    if (pending.length) return Promise.all(pending).then(fit);
    document.querySelectorAll(".bd-article mjx-container[display='true']").forEach(function (m) {
      if (m.dataset.wtmgSize === undefined) m.dataset.wtmgSize = m.style.fontSize || "";
      m.style.fontSize = m.dataset.wtmgSize;
      if (!tooWide(m)) return;
      var scale = (m.clientWidth - 2) / m.scrollWidth;
      if (scale < MIN_SCALE) return;
      var base = parseFloat(m.dataset.wtmgSize) || 100;   // MathJax writes e.g. "127.3%"
      m.style.fontSize = (base * scale).toFixed(1) + "%";
    });
    window.dispatchEvent(new Event("wtmg-layout"));   // the scroll cues look again
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

// A box that scrolls sideways (a wide table, an output, code, an equation) and whose content is
// wider than it gets the classes wtmg-scrolls and wtmg-more-right / wtmg-more-left while there
// is more to see on that side: course.css fades that edge out. Looked at again when the page
// has drawn (MathJax, widgets), when the window's width changes and as the reader scrolls.
(function () {
  var SIDEWAYS = /^(auto|scroll)$/;
  function mark(box) {
    var over = box.scrollWidth > box.clientWidth + 1;
    box.classList.toggle("wtmg-scrolls", over);
    box.classList.toggle("wtmg-more-left", over && box.scrollLeft > 1);
    box.classList.toggle("wtmg-more-right", over && box.scrollLeft + box.clientWidth < box.scrollWidth - 1);
  }
  function look() {
    document.querySelectorAll(".bd-article *").forEach(function (el) {
      if (!SIDEWAYS.test(getComputedStyle(el).overflowX)) return;
      mark(el);
      if (!el.dataset.wtmgWatched) {
        el.dataset.wtmgWatched = "1";
        el.addEventListener("scroll", function () { mark(el); }, {passive: true});
      }
    });
  }
  var timer = null;
  function soon() { clearTimeout(timer); timer = setTimeout(look, 100); }
  window.addEventListener("load", soon);
  window.addEventListener("resize", soon);
  window.addEventListener("wtmg-layout", soon);
  document.addEventListener("DOMContentLoaded", soon);
})();
