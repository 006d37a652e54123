"""Sphinx extension: what the site needs to show cleanly in a browser (issue 17).

Found by tools/site_check.py (`make site-check`), fixed here rather than in each page:

- ``book/_static/course.css`` is added to every page (the CJK font, wide equations and
  outputs, tables and figures on a phone, figures in dark mode).
- An inline script registered twice is written once. sphinx-thebe and sphinx-book-theme both
  add thebe's settings (one with filename None, one with ""), so every page declared
  ``const THEBE_JS_URL`` twice:
  "SyntaxError: Identifier 'THEBE_JS_URL' has already been declared" in the console.
- The theme's ``default_mode`` (``html_context``) is "auto" unless _config.yml sets one: with the theme's empty
  default, a first visit logged "Got invalid theme mode: . Resetting to auto." as an error.
- A change in ``book/_static`` alone (course.css, course.js) leaves no page out of date, and
  Sphinx then stops before copying the static files: ``make book`` kept serving the old
  course.css. The root page is then rebuilt, which copies them.

Loaded from _config.yml: ``sphinx.local_extensions: {site_fixes: book/_ext}``.
"""
from __future__ import annotations

from pathlib import Path


def _default_mode(app, config):
    # pydata-sphinx-theme reads it from html_context (not a theme option)
    if not (config.html_context or {}).get("default_mode"):
        config.html_context = {**(config.html_context or {}), "default_mode": "auto"}


def _add_css(app):
    app.add_css_file("course.css")


def _unique_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        key = (str(getattr(js, "filename", js) or ""),  # inline: None from one, "" from another
               tuple(sorted((getattr(js, "attributes", None) or {}).items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    context["script_files"] = unique


def _static_changed(app, env, added, changed, removed):
    out = Path(app.outdir) / "_static"
    for folder in app.config.html_static_path:
        source = Path(app.confdir) / folder
        for path in source.rglob("*"):
            copy = out / path.relative_to(source)
            if path.is_file() and (not copy.is_file() or copy.stat().st_mtime < path.stat().st_mtime):
                return [app.config.root_doc]
    return []


def setup(app):
    app.connect("config-inited", _default_mode)
    app.connect("builder-inited", _add_css)
    app.connect("html-page-context", _unique_scripts, priority=900)
    app.connect("env-get-outdated", _static_changed)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
