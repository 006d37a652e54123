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

Loaded from _config.yml: ``sphinx.local_extensions: {site_fixes: book/_ext}``.
"""
from __future__ import annotations


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


def setup(app):
    app.connect("config-inited", _default_mode)
    app.connect("builder-inited", _add_css)
    app.connect("html-page-context", _unique_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
