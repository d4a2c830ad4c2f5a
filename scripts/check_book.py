#!/usr/bin/env python3
"""Checks the guide, for scripts/book.sh: `check_book.py BOOK_DIR BUILD_LOG`.

mdBook only logs an include it cannot read, includes nothing for an anchor that does
not exist, and renders a link to a missing page or heading as is. This fails (exit 1,
one line per problem) on:

- in book/src: an `{{#include}}`/`{{#rustdoc_include}}` of a missing file, of a line
  range (use an anchor), or of an anchor that is missing or empty; a Rust code block
  that holds anything but includes (the book's code comes from compiled, tested
  files); an `ignore` code block;
- in mdBook's log: any ERROR or WARN line;
- in the built HTML: a relative link to a missing file or to a heading (`#id`) that
  the target page does not have, and any `{{#…}}` left unexpanded.

Links to other sites are not fetched (CI must not depend on them).
"""
import html
import os
import re
import sys
from urllib.parse import unquote

INCLUDE = re.compile(r"\{\{#(include|rustdoc_include)\s+([^}\s]+)\s*\}\}")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\n`]*)$")


def check_sources(src, problems):
    for dirpath, _, files in os.walk(src):
        for name in sorted(files):
            if not name.endswith(".md"):
                continue
            md = os.path.join(dirpath, name)
            rel = os.path.relpath(md, src)
            with open(md, encoding="utf-8") as f:
                lines = f.read().split("\n")
            for no, line in enumerate(lines, 1):
                for m in INCLUDE.finditer(line):
                    check_include(md, rel, no, m.group(2), problems)
            check_code_blocks(rel, lines, problems)


def check_include(md, rel, no, spec, problems):
    path, _, sel = spec.partition(":")
    target = os.path.normpath(os.path.join(os.path.dirname(md), path))
    where = f"{rel}:{no}: {{{{#include {spec}}}}}"
    if not os.path.isfile(target):
        problems.append(f"{where}: no file {target}")
        return
    if not sel:
        return
    if re.fullmatch(r"[0-9:]*", sel):
        problems.append(f"{where}: a line range; mark the lines with ANCHOR comments instead")
        return
    with open(target, encoding="utf-8") as f:
        text = f.read().split("\n")
    start = [i for i, l in enumerate(text) if re.search(rf"ANCHOR:\s*{re.escape(sel)}\b", l)]
    end = [i for i, l in enumerate(text) if re.search(rf"ANCHOR_END:\s*{re.escape(sel)}\b", l)]
    if not start or not end:
        problems.append(f"{where}: no anchor '{sel}' (ANCHOR and ANCHOR_END) in {path}")
        return
    body = [l for l in text[start[0] + 1 : end[0]] if "ANCHOR" not in l and l.strip()]
    if not body:
        problems.append(f"{where}: anchor '{sel}' in {path} holds no lines")


def check_code_blocks(rel, lines, problems):
    fence = None
    for no, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence, info, start = m.group(2), m.group(3).strip(), no
                lang = re.split(r"[,\s]", info)[0] if info else ""
                if "ignore" in re.split(r"[,\s]+", info):
                    problems.append(f"{rel}:{no}: an `ignore` code block; include a compiled, tested file")
                body = []
        elif m and m.group(2).startswith(fence) and not m.group(3).strip():
            if lang in ("rust", "rs") and any(
                l.strip() and not INCLUDE.fullmatch(l.strip()) for l in body
            ):
                problems.append(
                    f"{rel}:{start}: Rust code written in the page; include it from a compiled, tested file"
                )
            fence = None
        else:
            body.append(line)


def check_log(log, problems):
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            if re.search(r"\b(ERROR|WARN)\b", line):
                problems.append(f"mdbook: {line.strip()}")


def check_html(out, problems):
    pages = {}
    for dirpath, _, files in os.walk(out):
        for name in files:
            if name.endswith(".html") and name != "404.html":
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    pages[os.path.normpath(path)] = f.read()
    ids = {p: set(re.findall(r'\bid="([^"]+)"', t)) for p, t in pages.items()}
    for page, text in sorted(pages.items()):
        rel = os.path.relpath(page, out)
        if "{{#" in text:
            problems.append(f"{rel}: an unexpanded {{{{#…}}}} directive")
        for link in sorted(set(re.findall(r'\b(?:href|src)="([^"]*)"', text))):
            link = html.unescape(link)
            if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I) or link.startswith("//"):
                continue
            path, _, frag = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(page), unquote(path))) if path else page
            if not os.path.exists(target):
                problems.append(f"{rel}: link {link}: no file {os.path.relpath(target, out)}")
            elif frag and target.endswith(".html") and unquote(frag) not in ids.get(target, ()):
                problems.append(f"{rel}: link {link}: no heading #{frag} in {os.path.relpath(target, out)}")


def main():
    book, log = sys.argv[1], sys.argv[2]
    problems = []
    check_sources(os.path.join(book, "src"), problems)
    check_log(log, problems)
    check_html(os.path.join(book, "book"), problems)
    for p in problems:
        print(f"book: {p}", file=sys.stderr)
    if problems:
        print(f"book: {len(problems)} problem(s)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
