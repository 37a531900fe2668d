"""Regenerate the layout section of docs/ARCHITECTURE.md (one line per module, the first sentence of its docstring); run from the repository root after adding a module: tests/test_house.py checks that every module is named."""
import ast, os, re, sys
root = sys.argv[1] if len(sys.argv) > 1 else "."
groups = {}
for top in ("parallel_models", "conversion"):
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith(".py"): continue
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            doc = ast.get_docstring(ast.parse(open(p).read())) or ""
            text = " ".join(doc.split())
            m = re.match(r"(.+?[.])(\s|$)", text)
            first = (m.group(1) if m else text)
            if len(first) > 200:
                cut = first[:200].rsplit(" ", 1)[0].rstrip(",;:(")
                first = cut + " ..."
            groups.setdefault(os.path.relpath(dirpath, root), []).append((rel, first))
lines = []
for d in sorted(groups, key=lambda d: (d.count("/"), d) if False else d):
    lines.append(f"\n**{d}/**\n")
    items = sorted(groups[d], key=lambda x: (not x[0].endswith("__init__.py"), x[0]))
    for rel, first in items:
        lines.append(f"- `{rel}`: {first}")
section = "\n".join(lines).lstrip("\n")
path = os.path.join(root, "docs", "ARCHITECTURE.md")
s = open(path).read()
start = s.index("<!-- layout:")
start = s.index("-->", start) + 3
end = s.index("\n## Formats")
s = s[:start] + "\n" + section + "\n" + s[end:]
open(path, "w").write(s)
