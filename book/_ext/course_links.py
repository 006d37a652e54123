"""Sphinx role ``{src}`labkit/lab2/lomo.py``` → a link to that file in the course repository.

The link is built from the repository URL and branch that Jupyter Book passes to the theme
(``repository.url`` and ``repository.branch`` in ``_config.yml``), so a course host who moves
the repository changes one setting and every link follows.  ``{src}`text <labkit/lab2/zero1.py>```
sets the link text.
"""
from __future__ import annotations

import re

from docutils import nodes

_EXPLICIT = re.compile(r"^(?P<text>.+?)\s*<(?P<path>[^<>]+)>$")


def _src_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    config = inliner.document.settings.env.config
    theme = config.html_theme_options or {}
    url = theme.get("repository_url", "").rstrip("/")
    branch = theme.get("repository_branch", "") or "main"
    if not url:
        message = inliner.reporter.error("{src} needs repository.url in _config.yml", line=lineno)
        return [inliner.problematic(rawtext, rawtext, message)], [message]
    m = _EXPLICIT.match(text)
    label, path = (m["text"], m["path"]) if m else (text, text)
    path = path.strip().lstrip("/")
    if not path.startswith(("src/", "tests/", "labs/", "solutions/", "tools/")):
        path = "src/" + path  # {src}`labkit/x.py` means src/labkit/x.py
    node = nodes.reference(rawtext, "", refuri=f"{url}/blob/{branch}/{path}", **(options or {}))
    node += nodes.literal(label, label)
    return [node], []


def setup(app):
    app.add_role("src", _src_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
