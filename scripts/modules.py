#!/usr/bin/env python3
"""The module graph of the `tch-distributed` crate (sdk/src), and a check that it has no cycle.

    python3 scripts/modules.py            the graph, one block per parent module
    python3 scripts/modules.py --why      the same, each edge with the lines that make it
    python3 scripts/modules.py --check    exits 1 and names every cycle (with its lines)
    python3 scripts/modules.py --dot      Graphviz (`... --dot | dot -Tsvg > modules.svg`)

Python 3 standard library only. It reads the crate the way rustc finds its files: from
`sdk/src/lib.rs`, following `mod x;` (to `x.rs` or `x/mod.rs`, under the directory of a
`lib.rs`/`mod.rs` file or of `#[path]`-loaded file, else under `dir/name/` of a `name.rs`
file) and `#[path = "..."]` attributes. Inline modules (`mod tests { ... }`) are modules
too. Comments (doc comments and their intra-doc links included) and string literals are
not code and are skipped.

What an edge is
---------------
Module A refers to module B when code in A (outside comments) names an item of B: a `use`
declaration or a path such as `crate::b::Item`, `super::b::f()`, `self::x`, or a path
through a name that A imported or a child module (`use crate::b; b::f()`). Each path is
resolved as rustc would: `crate`, `super` and `self` first, then child modules, then names
imported with `use` (re-exports are followed, so `crate::Store` is `store`'s `Store`, and a
glob re-export is followed when its module defines or imports the name), and the item is in
the last module the path reaches. Naming a module itself (`use crate::init;`) refers to it.
Paths that reach no module of the crate (`std::...`, `tch::...`, locals) are ignored.

The graph collapses every reference to the nearest modules that are not ancestors of one
another: a reference from `a::x::y` to `a::z::w` is an edge `x -> z` among the children of
`a` (their nearest common ancestor); a reference from `a::x` to `b` is `a -> b` among the
top-level modules. So a child's references count for its parent, and a module that refers to
its own children (or a child to its parent, e.g. `use super::*`) makes no edge. Each parent
module gets its own graph of its children; the crate root's is the top-level graph.

A cycle is a strongly connected component (Tarjan) of more than one module in any of these
graphs. `--check` lists each, with the references that make its edges, and exits 1.
"""

import argparse
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "sdk", "src")

# ----------------------------------------------------------------------------- lexing


def tokenize(text):
    """Tokens (kind, value, line) of Rust source: 'id' (identifiers, keywords, numbers),
    'str' (string literals, value without quotes or escapes decoded) and 'p' (one punctuation
    character, or '::'). Comments, char literals and lifetimes are dropped."""
    toks = []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += text[i] == "\n"
                    i += 1
        elif c in "rb" and _raw_string_at(text, i):
            j = i + (2 if text.startswith("br", i) else 1)
            hashes = 0
            while text[j] == "#":
                hashes, j = hashes + 1, j + 1
            end = text.find('"' + "#" * hashes, j + 1)
            end = n if end < 0 else end
            toks.append(("str", text[j + 1 : end], line))
            line += text.count("\n", i, end)
            i = end + 1 + hashes
        elif c == '"' or (c == "b" and text.startswith('b"', i)):
            j = i + (2 if c == "b" else 1)
            start, buf = j, []
            while j < n and text[j] != '"':
                if text[j] == "\\":
                    j += 1
                buf.append(text[j])
                j += 1
            toks.append(("str", "".join(buf), line))
            line += text.count("\n", i, j)
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}') or a lifetime/label ('a, 'static).
            if i + 1 < n and text[i + 1] == "\\":
                j = text.find("'", i + 3)
                i = j + 1
            elif i + 2 < n and text[i + 2] == "'":
                i += 3
            else:
                i += 1
                while i < n and (text[i].isalnum() or text[i] == "_"):
                    i += 1
        elif c.isalnum() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            if word.startswith("r#"):
                word = word[2:]
            toks.append(("id", word, line))
            i = j
        elif text.startswith("::", i):
            toks.append(("p", "::", line))
            i += 2
        else:
            toks.append(("p", c, line))
            i += 1
    return toks


def _raw_string_at(text, i):
    j = i + 1
    if text.startswith("br", i):
        j = i + 2
    elif text[i] != "r":
        return False
    if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
        return False
    while j < len(text) and text[j] == "#":
        j += 1
    return j < len(text) and text[j] == '"'


# ----------------------------------------------------------------------------- the tree


class Module:
    def __init__(self, path, file, mod_rs, dir_):
        self.path = path  # tuple of names, () for the crate root
        self.file = file  # the file that holds it (an inline module shares its parent's)
        self.mod_rs = mod_rs  # lib.rs, mod.rs or #[path]: its children live in its directory
        self.dir = dir_  # the directory that its out-of-line children are found in
        self.children = {}  # name -> Module
        self.imports = {}  # name -> ('rel', scope path, segments) as written
        self.globs = []  # (scope path, segments) of `use ...::*`
        self.items = set()  # names that it defines (fn, struct, ...)
        self.refs = []  # (segments, line, text), paths it names, resolved later

    @property
    def name(self):
        return "crate" if not self.path else "::".join(self.path)


ITEM_KEYWORDS = {"fn", "struct", "enum", "trait", "type", "const", "static", "union"}
VISIBILITY = {"pub", "(", ")", "crate", "super", "self", "in"}


class Crate:
    def __init__(self, src):
        self.src = src
        self.modules = {}
        self.files = []
        self.problems = []
        self.top_paths = set()  # modules that are a file's top (not inline)
        self.load(os.path.join(src, "lib.rs"), (), mod_rs=True)

    def rel(self, file):
        return os.path.relpath(file, ROOT)

    def load(self, file, path, mod_rs):
        with open(file, encoding="utf-8") as f:
            toks = tokenize(f.read())
        self.files.append(file)
        d = os.path.dirname(file)
        if not mod_rs:
            d = os.path.join(d, os.path.splitext(os.path.basename(file))[0])
        top = Module(path, file, mod_rs, d)
        self.top_paths.add(path)
        self.modules[path] = top
        self.parse(toks, top)

    def parse(self, toks, top):
        stack = [(top, 0)]  # (module, brace depth of its body)
        depth = 0
        i = 0
        n = len(toks)
        while i < n:
            kind, val, line = toks[i]
            mod = stack[-1][0]
            if kind == "p" and val == "{":
                depth += 1
            elif kind == "p" and val == "}":
                depth -= 1
                if len(stack) > 1 and depth < stack[-1][1]:
                    stack.pop()
            elif kind == "id" and val == "mod" and i + 2 < n and toks[i + 1][0] == "id":
                name = toks[i + 1][1]
                nxt = toks[i + 2][1]
                if nxt == "{":
                    child = Module(mod.path + (name,), mod.file, False, os.path.join(mod.dir, name))
                    mod.children[name] = child
                    self.modules[child.path] = child
                    depth += 1
                    stack.append((child, depth))
                    i += 3
                    continue
                if nxt == ";":
                    self.declare(mod, name, self.path_attribute(toks, i))
                    i += 3
                    continue
            elif kind == "id" and val == "use" and (i == 0 or toks[i - 1][1] != "::"):
                j = i + 1
                trees = []
                j = self.use_tree(toks, j, [], trees)
                for segs, alias, ln in trees:
                    if segs and segs[-1] == "*":
                        mod.globs.append((mod.path, segs[:-1]))
                        mod.refs.append((segs[:-1], ln, "::".join(segs)))
                        continue
                    if segs and segs[-1] == "self":
                        segs = segs[:-1]
                    if not segs:
                        continue
                    name = alias or segs[-1]
                    if name != "_":
                        mod.imports[name] = (mod.path, segs)
                    mod.refs.append((segs, ln, "::".join(segs)))
                i = j
                continue
            elif kind == "id" and val in ITEM_KEYWORDS and depth == stack[-1][1]:
                if i + 1 < n and toks[i + 1][0] == "id":
                    mod.items.add(toks[i + 1][1])
            elif kind == "id" and val == "macro_rules" and i + 2 < n and toks[i + 1][1] == "!":
                mod.items.add(toks[i + 2][1])
            elif kind == "id" and (i == 0 or toks[i - 1][1] not in ("::", ".")):
                # A path: IDENT (:: IDENT)*. Resolved later; most resolve to nothing.
                segs = [val]
                j = i + 1
                while j + 1 < n and toks[j][1] == "::" and toks[j + 1][0] == "id":
                    segs.append(toks[j + 1][1])
                    j += 2
                if len(segs) > 1 or val in ("crate", "super", "self"):
                    mod.refs.append((segs, line, "::".join(segs)))
                    i = j
                    continue
            i += 1

    def use_tree(self, toks, j, prefix, out):
        """Parses the use tree at toks[j] (after `use`, or inside a `{...}` group) and appends
        (segments, alias, line) for each name that it imports; returns the index after it
        (after the `;` at the top level)."""
        segs = list(prefix)
        n = len(toks)
        while j < n:
            kind, val, line = toks[j]
            if val == "::":
                j += 1
            elif kind == "id" and val == "as":
                out.append((segs, toks[j + 1][1], line))
                j += 2
                break
            elif kind == "id" or val == "*":
                segs.append(val)
                j += 1
            elif val == "{":
                j += 1
                while j < n and toks[j][1] != "}":
                    j = self.use_tree(toks, j, segs, out)
                    if toks[j][1] == ",":
                        j += 1
                j += 1
                break
            else:
                if len(segs) > len(prefix):
                    out.append((segs, None, line))
                break
        if not prefix and j < n and toks[j][1] == ";":
            j += 1
        return j

    def path_attribute(self, toks, i):
        """The `#[path = "..."]` before the `mod` at toks[i], if any."""
        j = i - 1
        while j >= 0 and toks[j][1] in VISIBILITY:
            j -= 1
        while j >= 0 and toks[j][1] == "]":
            k, level = j, 0
            while k >= 0:
                if toks[k][1] == "]":
                    level += 1
                elif toks[k][1] == "[":
                    level -= 1
                    if level == 0:
                        break
                k -= 1
            body = toks[k + 1 : j]
            if len(body) == 3 and body[0][1] == "path" and body[1][1] == "=" and body[2][0] == "str":
                return body[2][1]
            j = k - 2  # before '#'
        return None

    def declare(self, parent, name, path_attr):
        if path_attr is not None:
            # Relative to the directory of the file; inside an inline module, to its dir.
            top = self.modules[parent.path] is parent and parent.path in self.top_paths
            base = os.path.dirname(parent.file) if top else parent.dir
            file = os.path.normpath(os.path.join(base, path_attr))
            mod_rs = True
        else:
            a = os.path.join(parent.dir, name + ".rs")
            b = os.path.join(parent.dir, name, "mod.rs")
            if os.path.exists(a) and os.path.exists(b):
                self.problems.append(f"both {self.rel(a)} and {self.rel(b)} exist")
            if os.path.exists(a):
                file, mod_rs = a, False
            elif os.path.exists(b):
                file, mod_rs = b, True
            else:
                self.problems.append(f"mod {name} in {self.rel(parent.file)}: no file")
                return
        self.load(file, parent.path + (name,), mod_rs)
        parent.children[name] = self.modules[parent.path + (name,)]

    # ------------------------------------------------------------------------- resolving

    def resolve(self, scope, segs, seen=None):
        """The module whose item the path names, written in module `scope`; None when the
        path leaves the crate or names nothing of it."""
        seen = set() if seen is None else seen
        segs = list(segs)
        if not segs:
            return None
        first = segs[0]
        if first == "crate":
            mod, segs = self.modules[()], segs[1:]
        elif first in ("super", "self"):
            path = scope
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    if not path:
                        return None
                    path = path[:-1]
                segs = segs[1:]
            mod = self.modules[path]
        else:
            # Relative: a child module, else a name the scope imports, else not ours.
            mod = self.modules[scope]
            if first not in mod.children and first not in mod.imports:
                return None
        return self.walk(mod, segs, seen)

    def walk(self, mod, segs, seen):
        while segs:
            s = segs[0]
            if s in mod.children:
                mod, segs = mod.children[s], segs[1:]
                continue
            if s in mod.imports:
                key = (mod.path, s)
                if key in seen:
                    return mod
                seen.add(key)
                scope, target = mod.imports[s]
                r = self.resolve(scope, list(target) + segs[1:], seen)
                return r if r is not None else mod
            if s not in mod.items:
                for scope, gsegs in mod.globs:
                    g = self.resolve(scope, gsegs, seen)
                    if g is not None and g is not mod and (
                        s in g.items or s in g.imports or s in g.children
                    ):
                        key = (mod.path, "*", g.path)
                        if key in seen:
                            continue
                        seen.add(key)
                        return self.walk(g, segs, seen)
            return mod
        return mod

    def references(self):
        """(from module path, to module path, file, line, text) for every reference that
        reaches a module of the crate."""
        out = []
        for mod in self.modules.values():
            for segs, line, text in mod.refs:
                target = self.resolve(mod.path, segs)
                if target is not None:
                    out.append((mod.path, target.path, mod.file, line, text))
        return out


# ----------------------------------------------------------------------------- graphs


def collapse(a, b):
    """The edge that a reference from a to b makes: (parent, child of parent toward a,
    child of parent toward b), or None when one is the other's ancestor."""
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    if k == len(a) or k == len(b):
        return None
    return a[:k], a[k], b[k]


def tarjan(nodes, edges):
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def simple_cycles(comp, edges, limit=100):
    """Every elementary cycle within a strongly connected component (each once, starting
    from its smallest module), shortest first; at most `limit`."""
    inside = set(comp)
    out = []

    def walk(start, path, on_path):
        for w in sorted(edges.get(path[-1], ())):
            if len(out) >= limit:
                return
            if w == start:
                out.append(path + [start])
            elif w in inside and w > start and w not in on_path:
                on_path.add(w)
                walk(start, path + [w], on_path)
                on_path.discard(w)

    for start in sorted(comp):
        walk(start, [start], {start})
    return sorted(out, key=lambda c: (len(c), c))


def evidence(refs):
    """One line per distinct path that a file names: `file:line[,line...] path`."""
    lines = defaultdict(list)
    for file, line, text, _, _ in refs:
        if line not in lines[(file, text)]:
            lines[(file, text)].append(line)
    first = sorted(lines, key=lambda k: (k[0], lines[k][0]))
    return [f"{f}:{','.join(map(str, lines[(f, t)]))} {t}" for f, t in first]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 and name every cycle")
    ap.add_argument("--dot", action="store_true", help="print Graphviz")
    ap.add_argument("--why", action="store_true", help="list the references behind each edge")
    ap.add_argument("--src", default=SRC, help="the crate's src directory (default sdk/src)")
    args = ap.parse_args()

    crate = Crate(args.src)
    groups = defaultdict(lambda: defaultdict(list))  # parent -> (a, b) -> [(file, line, text)]
    for a, b, file, line, text in crate.references():
        e = collapse(a, b)
        if e is not None:
            parent, x, y = e
            groups[parent][(x, y)].append((crate.rel(file), line, text, a, b))

    def label(parent, child=None):
        p = parent + ((child,) if child else ())
        m = crate.modules[p]
        name = "crate" if not p else "::".join(p)
        if m.path and crate.modules[m.path[:-1]].file != m.file:
            return f"{name} ({crate.rel(m.file)})"
        return name

    cycles = []
    for parent in sorted(crate.modules):
        children = crate.modules[parent].children
        if not children:
            continue
        edges = defaultdict(set)
        for x, y in groups.get(parent, {}):
            edges[x].add(y)
        for comp in tarjan(list(children), edges):
            if len(comp) > 1:
                cycles.append((parent, comp, simple_cycles(comp, edges)))

    unread = []
    for dirpath, _, names in os.walk(args.src):
        for f in names:
            p = os.path.join(dirpath, f)
            if f.endswith(".rs") and p not in crate.files and os.sep + "bin" + os.sep not in p:
                unread.append(crate.rel(p))

    if args.dot:
        print("digraph modules {")
        print("  rankdir=LR; node [shape=box, fontname=monospace];")
        for parent in sorted(groups):
            pname = "crate" if not parent else "::".join(parent)
            print(f'  subgraph "cluster_{pname}" {{ label="{pname}";')
            for (x, y), why in sorted(groups[parent].items()):
                xa = "::".join(parent + (x,))
                ya = "::".join(parent + (y,))
                bad = any(parent == cp and x in comp and y in comp for cp, comp, _ in cycles)
                attr = ' [color=red, penwidth=2]' if bad else ""
                print(f'    "{xa}" -> "{ya}"{attr};')
            print("  }")
        print("}")
    elif not args.check:
        for parent in sorted(groups):
            print(f"{label(parent)}:")
            by_source = defaultdict(list)
            for (x, y), why in groups[parent].items():
                by_source[x].append((y, why))
            for x in sorted(crate.modules[parent].children):
                targets = sorted(by_source.get(x, []))
                if not targets:
                    continue
                print(f"  {x} -> {', '.join(y for y, _ in targets)}")
                if args.why:
                    for y, why in targets:
                        for line in evidence(why):
                            print(f"      -> {y}: {line}")
        print()

    for p in crate.problems:
        print(f"modules.py: {p}", file=sys.stderr)
    for f in unread:
        print(f"modules.py: {f} is in no module tree (no `mod` declares it)", file=sys.stderr)
    if not args.dot:
        count = sum(len(cs) for _, _, cs in cycles)
        print(f"{count} cycle(s)" + (":" if count else ""))
        for parent, comp, cs in cycles:
            pname = "crate" if not parent else "::".join(parent)
            for cyc in cs:
                print(f"  in {pname}: {' -> '.join(cyc)}")
            for x, y in sorted(
                {(x, y) for cyc in cs for x, y in zip(cyc, cyc[1:])}
            ):
                for line in evidence(groups[parent][(x, y)]):
                    print(f"      {x} -> {y}: {line}")
    if args.check and (cycles or crate.problems):
        sys.exit(1)


if __name__ == "__main__":
    main()
