"""Subset a CJK font to the characters the book uses, so that the Chinese epigraphs render offline.

    python tools/make_cjk_font.py            # (re)write book/_static/fonts/wtmg-cjk.woff
    python tools/make_cjk_font.py --check    # exit 1 if the book uses a character the font lacks

The characters are collected from every chapter (book/*.md) and lab (labs/*.ipynb): any code
point in the CJK blocks (ideographs, CJK punctuation, full-width forms, kana, hangul). A new
chapter's characters are picked up by running the script again; tests/test_site_check.py fails
(naming the characters) while the shipped font lacks one.

Source: Noto Sans CJK SC Regular (Debian's fonts-noto-cjk: /usr/share/fonts/opentype/noto/
NotoSansCJK-Regular.ttc), SIL Open Font License 1.1 (book/_static/fonts/LICENSE-noto-cjk.txt).
The subset is renamed "WTMG CJK" (a Modified Version under the OFL must not carry the upstream
name); book/_static/course.css declares it for the CJK code points only (unicode-range), so a
page without Chinese never loads it. fontTools' subsetter comes with matplotlib. The output is
WOFF (zlib): WOFF2 would need the brotli package, and the subset is a few kB either way.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "book" / "_static" / "fonts" / "wtmg-cjk.woff"
FAMILY = "WTMG CJK"
SOURCE = Path("/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc")
SOURCE_FAMILY = "Noto Sans CJK SC"
# The blocks that need a CJK font; the same ranges go into course.css's unicode-range.
CJK_RANGES = [(0x2E80, 0x2FDF), (0x3000, 0x303F), (0x3040, 0x30FF), (0x3100, 0x31FF),
              (0x3200, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7AF), (0xF900, 0xFAFF),
              (0xFE30, 0xFE4F), (0xFF00, 0xFFEF), (0x20000, 0x2FA1F)]
CJK = re.compile("[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in CJK_RANGES) + "]")


def is_cjk(ch: str) -> bool:
    return bool(CJK.match(ch))


def _text_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text(encoding="utf-8"))
        parts = []
        for cell in nb.get("cells", []):
            src = cell.get("source", "")
            parts.append(src if isinstance(src, str) else "".join(src))
            for out in cell.get("outputs", []):  # printed outputs show on the site too
                parts.append(json.dumps(out, ensure_ascii=False))
        return "\n".join(parts)
    return path.read_text(encoding="utf-8")


def book_sources(root: Path = ROOT) -> list[Path]:
    return sorted((root / "book").glob("*.md")) + sorted((root / "labs").glob("*.ipynb"))


def book_characters(paths: list[Path] | None = None) -> str:
    """The CJK characters of the given files (default: every chapter and lab), sorted."""
    chars: set[str] = set()
    for path in paths if paths is not None else book_sources():
        chars.update(CJK.findall(_text_of(path)))
    return "".join(sorted(chars))


def font_characters(path: Path = OUT) -> str:
    """The characters that the font at path has glyphs for."""
    from fontTools.ttLib import TTFont

    return "".join(sorted(chr(c) for c in TTFont(path).getBestCmap()))


def missing_characters(paths: list[Path] | None = None, font: Path = OUT) -> str:
    have = set(font_characters(font)) if font.exists() else set()
    return "".join(c for c in book_characters(paths) if c not in have)


def _source_index(ttc: Path, family: str) -> int:
    from fontTools.ttLib import TTCollection

    for i, font in enumerate(TTCollection(ttc, lazy=True).fonts):
        if font["name"].getDebugName(1) == family:
            return i
    raise ValueError(f"family must be one of the fonts in {ttc}; {family!r} is not there")


def make_font(chars: str, out: Path = OUT, source: Path = SOURCE) -> int:
    """Write the subset of source with chars (plus space) to out as WOFF; returns its size."""
    from fontTools import subset
    from fontTools.ttLib import TTFont

    if not chars:
        raise ValueError("chars must name at least one character to keep")
    if not source.exists():
        raise FileNotFoundError(f"no {source}: apt-get install -y fonts-noto-cjk")
    font = TTFont(source, fontNumber=_source_index(source, SOURCE_FAMILY), lazy=False)
    options = subset.Options()
    options.flavor = "woff"
    options.layout_features = ["*"]      # keep vertical forms, punctuation spacing (halt, vpal...)
    options.name_IDs = ["*"]
    options.notdef_outline = True
    options.drop_tables += ["DSIG"]
    sub = subset.Subsetter(options)
    sub.populate(text=chars + " ")
    sub.subset(font)
    names = font["name"]
    for record in list(names.names):     # the Modified Version takes its own name (OFL §3)
        if record.nameID in (1, 3, 4, 6, 16, 17, 18, 21, 22):
            text = {1: FAMILY, 4: FAMILY, 6: FAMILY.replace(" ", "") + "-Regular", 16: FAMILY,
                    3: f"{FAMILY}: subset of {SOURCE_FAMILY} for Where the Memory Goes",
                    17: "Regular", 18: FAMILY, 21: FAMILY, 22: "Regular"}[record.nameID]
            names.setName(text, record.nameID, record.platformID, record.platEncID, record.langID)
    out.parent.mkdir(parents=True, exist_ok=True)
    font.flavor = "woff"
    font.save(out, reorderTables=True)
    return out.stat().st_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only check that the shipped font covers the book's characters")
    ap.add_argument("--also", nargs="*", type=Path, default=[],
                    help="more .md/.ipynb files whose characters to include")
    args = ap.parse_args(argv)
    paths = book_sources() + list(args.also)
    if args.check:
        missing = missing_characters(paths)
        if missing:
            print(f"{OUT.relative_to(ROOT)} lacks {missing!r}: run python tools/make_cjk_font.py")
            return 1
        print(f"{OUT.relative_to(ROOT)} covers the book's {len(book_characters(paths))} CJK characters")
        return 0
    chars = book_characters(paths)
    size = make_font(chars)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(chars)} characters {chars}, {size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
