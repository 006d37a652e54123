// In-page checks of tools/site_check.py: evaluated in each page after it has loaded.
// Returns {problems: [...], links: [...], dark}; the links are checked in Python against the
// files of the site. __SETTLE_MS__, __DARK__ and __PRINT__ are filled in by site_check.py.
(async () => {
  const SETTLE_MS = __SETTLE_MS__, DARK = __DARK__, PRINT = __PRINT__, WARN = "warning: ";
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const start = performance.now();
  const problems = [];
  const describe = (el) => {
    let what = el.tagName.toLowerCase();
    if (el.closest("mjx-container")) what = "equation";
    else if (el.closest("table")) what = "table";
    else if (el.closest(".cell_output, .output")) what = "output";
    else if (el.closest("pre, .highlight")) what = "code";
    else if (el.closest("figure, img, svg")) what = "figure";
    else if (el.closest(".wtmg-calculator")) what = "calculator";
    const section = el.closest("section[id]");
    let text = (el.getAttribute("alt") || el.textContent || "").replace(/\s+/g, " ").trim();
    if (el.closest("mjx-container")) {
      const c = el.closest("mjx-container");
      const tex = c.querySelector("mjx-assistive-mml") ? "" : "";
      text = (c.getAttribute("aria-label") || c.textContent || "").replace(/\s+/g, " ").trim();
    }
    return `${what} <${el.tagName.toLowerCase()}${el.className && typeof el.className === "string" ? "." + el.className.trim().split(/\s+/).join(".") : ""}>` +
           (section ? ` in #${section.id}` : "") + (text ? ` "${text.slice(0, 60)}"` : "");
  };

  // 1. wait for MathJax, then for the widgets and calculators to draw
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await Promise.race([MathJax.startup.promise, sleep(SETTLE_MS)]);
  }
  const widgetScripts = () => [...document.querySelectorAll(
    "script[type='application/vnd.jupyter.widget-view+json']")];
  const drawn = (s) => {
    const box = s.parentElement;
    const views = box ? box.querySelectorAll(".jupyter-widgets, .widget-container, .lm-Widget") : [];
    return [...views].some((v) => v.getBoundingClientRect().height > 0);
  };
  const calculators = () => [...document.querySelectorAll(".wtmg-calculator")];
  const calcDrawn = (c) => {
    const svg = c.querySelector("svg");
    return svg && svg.childElementCount > 0 && svg.getBoundingClientRect().height > 0;
  };
  while (performance.now() - start < SETTLE_MS &&
         (widgetScripts().some((s) => !drawn(s)) || calculators().some((c) => !calcDrawn(c)))) {
    await sleep(100);
  }
  await sleep(400);  // fonts, last reflows, course.js's layout (equations, scroll cues)
  if (document.fonts) await Promise.race([document.fonts.ready, sleep(2000)]);

  widgetScripts().forEach((s, i) => {
    if (!drawn(s)) problems.push(`widget ${i + 1} did not draw`);
    const error = s.parentElement && /Error displaying widget[^\n]*/.exec(s.parentElement.textContent);
    if (error) problems.push(`widget ${i + 1}: ${error[0].slice(0, 120)}`);
  });
  calculators().forEach((c) => {
    if (!calcDrawn(c)) problems.push(`calculator #${c.id} did not draw its chart`);
    const msg = c.querySelector(".wtmg-msg");
    if (msg && msg.textContent.trim()) problems.push(`calculator #${c.id} says: ${msg.textContent.trim()}`);
  });

  // 2. math: every TeX source typeset, no MathJax error
  document.querySelectorAll("mjx-merror, .MathJax_Error").forEach((e) =>
    problems.push(`equation error: ${(e.getAttribute("data-mjx-error") || e.textContent).slice(0, 100)}`));
  document.querySelectorAll(".math").forEach((m) => {
    if (!m.querySelector("mjx-container") && /\\\(|\\\[|\$\$/.test(m.textContent))
      problems.push(`equation not typeset: ${m.textContent.trim().slice(0, 60)}`);
  });

  // 3. images: alt text; in dark mode, a light backdrop behind each figure
  const lum = (rgb) => {
    const v = rgb.match(/[\d.]+/g).map(Number);
    return v.length === 4 && v[3] === 0 ? null : (0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]) / 255;
  };
  const backdrop = (el) => {
    for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
      const l = lum(getComputedStyle(e).backgroundColor);
      if (l !== null) return l;
    }
    return lum(getComputedStyle(document.documentElement).backgroundColor) ?? 1;
  };
  document.querySelectorAll("img").forEach((img) => {
    const r = img.getBoundingClientRect();
    const src = img.getAttribute("src") || "";
    const name = src.startsWith("data:") ? `${src.slice(0, 22)}… (inline)` : src.split("/").pop();
    const alt = (img.getAttribute("alt") || "").trim();
    if (!alt && img.getAttribute("role") !== "presentation" && img.getAttribute("aria-hidden") !== "true")
      problems.push(`image without alt text: ${name}`);
    else if (alt && (alt === src || /\.(png|jpe?g|svg|gif|webp)$/i.test(alt)))
      problems.push(`${WARN}image whose alt text is its file name: ${name} ` +
                    `(give the figure an alt text: cell metadata mystnb.image.alt)`);
    if (!img.complete || (img.naturalWidth === 0 && r.width > 0))
      problems.push(`image did not load: ${name}`);
    if (DARK && r.width > 0 && img.closest("article") && backdrop(img) < 0.6)
      problems.push(`dark mode: image ${name} sits on a dark backdrop (luminance ${backdrop(img).toFixed(2)} < 0.6)`);
  });
  if (DARK) {
    document.querySelectorAll("article svg").forEach((svg) => {
      if (svg.closest("mjx-container, button, .fa, i, a, label, .headerlink")) return;
      const r = svg.getBoundingClientRect();
      if (r.width >= 100 && backdrop(svg) < 0.6)
        problems.push(`dark mode: figure <svg> sits on a dark backdrop (luminance ${backdrop(svg).toFixed(2)} < 0.6)`);
    });
  }

  // (dark mode) text against its backdrop: contrast ratio at least 3 (WCAG's floor, large text)
  if (DARK) {
    const rel = (rgb) => {
      const v = rgb.match(/[\d.]+/g).map(Number);
      if (v.length === 4 && v[3] === 0) return null;
      const c = v.slice(0, 3).map((x) => (x /= 255) <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4);
      return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
    };
    const behind = (el) => {
      for (let e = el; e && e.nodeType === 1; e = e.parentElement) {
        const l = rel(getComputedStyle(e).backgroundColor);
        if (l !== null) return l;
      }
      return rel(getComputedStyle(document.body).backgroundColor) ?? 1;
    };
    const seen = new Set(), walker = document.createTreeWalker(
      document.querySelector("article") || document.body, NodeFilter.SHOW_TEXT);
    let low = 0;
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const el = n.parentElement;
      if (!n.data.trim() || !el || seen.has(el)) continue;
      seen.add(el);
      if (el.closest(".headerlink, mjx-assistive-mml, script, style") || !el.getClientRects().length) continue;
      const fg = rel(getComputedStyle(el).color);
      if (fg === null) continue;
      const bg = behind(el), ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
      if (ratio < 3 && low++ < 5)
        problems.push(`dark mode: text with contrast ${ratio.toFixed(2)} < 3 against its backdrop: ${describe(el)}`);
    }
  }

  // 4. horizontal overflow: past the article's column and not inside a scrolling/clipping box
  const W = document.documentElement.clientWidth;
  if (document.documentElement.scrollWidth > W + 1)
    problems.push(`the page is wider than the window: ${document.documentElement.scrollWidth} px > ${W} px`);
  const article = document.querySelector("article.bd-article") ||
                  document.querySelector("article") || document.querySelector("main");
  if (article) {
    const col = article.getBoundingClientRect();
    // Past the column, el is fine inside a box that scrolls x (on a screen: paper does not
    // scroll, so in print that box cuts it); a box that clips x (hidden) and that el reaches
    // past cuts it off; with neither up to the article, it sticks out.
    const fate = (el, r) => {
      for (let e = el.parentElement; e && e !== article; e = e.parentElement) {
        const ox = getComputedStyle(e).overflowX;
        if ((ox === "auto" || ox === "scroll") && !PRINT) return "scrolls";
        if (ox !== "visible") {
          const b = e.getBoundingClientRect();
          if (r.right > b.right + 1 || r.left < b.left - 1) return "cut";
        }
      }
      return "sticks out";
    };
    const reported = new Set();
    for (const el of article.querySelectorAll("*")) {
      if (el.closest("mjx-assistive-mml, .visually-hidden, .sr-only")) continue;
      const r = el.getBoundingClientRect();
      if (r.width === 0 || r.height === 0) continue;
      if (r.right <= col.right + 1 && r.left >= col.left - 1) continue;
      const how = fate(el, r);
      if (how === "scrolls") continue;
      let parentReported = false;
      for (let p = el.parentElement; p && p !== article; p = p.parentElement)
        if (reported.has(p)) { parentReported = true; break; }
      reported.add(el);
      if (parentReported) continue;
      const over = Math.round(Math.max(r.right - col.right, col.left - r.left));
      problems.push(`${describe(el)} reaches ${over} px past its column (${Math.round(col.width)} px) and ` +
                    (how === "cut" ? (PRINT ? `is cut off at the paper's edge (print: a box that scrolls on the screen cuts it)`
                                            : `is cut off (a box with overflow-x: hidden, not a scrolling one)`)
                                   : `does not scroll`));
    }
  }

  // 4c. a box that scrolls sideways must look scrollable: a phone shows no scroll bar until
  // touched, so without a cue (course.js's fade at the edge with more) a wide table looks cut.
  if (article && !PRINT) {
    let boxes = 0;
    for (const el of article.querySelectorAll("*")) {
      const style = getComputedStyle(el);
      if (!/^(auto|scroll)$/.test(style.overflowX) || el.scrollWidth <= el.clientWidth + 1) continue;
      if (!el.getClientRects().length) continue;
      const mask = style.maskImage || style.webkitMaskImage || "none";
      if (mask === "none" && boxes++ < 5)
        problems.push(`${describe(el.firstElementChild || el)} scrolls sideways (${el.scrollWidth} px in ` +
                      `${el.clientWidth} px) with no cue that it does (no fade at its edge)`);
    }
  }

  // 4d. one search box on the screen (the theme's top bar and the sidebar each had one)
  if (!PRINT) {
    const searches = [...document.querySelectorAll(".search-button-field, input[type=search]")].filter((el) => {
      const r = el.getBoundingClientRect();
      return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== "hidden";
    });
    if (searches.length > 1)
      problems.push(`${searches.length} search boxes are shown: ` +
                    searches.map((el) => el.closest("[id]")?.id || el.className).join(", "));
  }

  // 4b. table cells: text squeezed into a column a few characters wide, or running past the
  // cell's own edge (clipped, or drawn over its neighbour)
  if (article) {
    let cells = 0;
    for (const cell of article.querySelectorAll("td, th")) {
      const text = cell.textContent.trim();
      if (!text || !cell.getClientRects().length) continue;
      const em = parseFloat(getComputedStyle(cell).fontSize) || 16;
      const w = cell.clientWidth;
      if (cell.scrollWidth > w + 1 && cells++ < 5)
        problems.push(`table cell clipped: its text needs ${cell.scrollWidth} px in ${w} px: ${describe(cell)}`);
      else if (text.length > 24 && w < 6 * em && cells++ < 5)
        problems.push(`table cell squeezed to ${w} px (under 6 em) for ${text.length} characters: ${describe(cell)}`);
    }
  }

  // An equation that fits only by scrolling sideways is readable but awkward: a warning, so that
  // the chapter can break it (aligned) where it is too wide.
  document.querySelectorAll("article mjx-container[display='true']").forEach((m) => {
    if (m.scrollWidth > m.clientWidth + 1 && m.clientWidth > 0)
      problems.push(`${WARN}equation scrolls sideways (${m.scrollWidth} px in ${m.clientWidth} px): ` +
                    describe(m.firstElementChild || m));
  });

  // 5. CJK text must have a web font of the site (a reader may have no CJK font installed)
  const CJK = /[\u2E80-\u2FDF\u3000-\u303F\u3040-\u30FF\u3100-\u31FF\u3200-\u4DBF\u4E00-\u9FFF\uAC00-\uD7AF\uF900-\uFAFF\uFE30-\uFE4F\uFF00-\uFFEF]+/;
  const loaded = new Set([...(document.fonts || [])].filter((f) => f.status === "loaded")
                           .map((f) => f.family.replace(/^["']|["']$/g, "")));
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const noFont = new Set();
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const m = n.data.match(CJK);
    if (!m || !n.parentElement || n.parentElement.closest("script, style, mjx-assistive-mml")) continue;
    if (!n.parentElement.getClientRects().length) continue;
    const families = getComputedStyle(n.parentElement).fontFamily.split(",")
                       .map((f) => f.trim().replace(/^["']|["']$/g, ""));
    if (!families.some((f) => loaded.has(f))) noFont.add(m[0]);
  }
  noFont.forEach((t) => problems.push(`CJK text "${t}" has no web font of the site: boxes where no CJK font is installed`));

  // 6. links: same-page anchors here; other pages of the site in Python
  const links = [];
  for (const a of document.querySelectorAll("a[href]")) {
    const href = a.getAttribute("href");
    if (!href || href.startsWith("javascript:") || href === "#") continue;
    const url = new URL(href, location.href);
    if (url.origin !== location.origin) continue;
    if (url.pathname === location.pathname && url.hash) {
      const id = decodeURIComponent(url.hash.slice(1));
      if (!document.getElementById(id) && !document.getElementsByName(id).length)
        problems.push(`broken anchor: ${href}`);
    } else {
      links.push(url.pathname + url.hash);
    }
  }
  return {problems, links: [...new Set(links)],
          dark: document.documentElement.dataset.theme === "dark"};
})()
