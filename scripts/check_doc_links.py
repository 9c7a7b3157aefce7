#!/usr/bin/env python3
"""Checks that every stage's docs page links, in one step, to the code, test and benchmark that
docs/architecture.md's table "Stages: docs, code, test, benchmark" gives for it, and that every
link target exists."""
import os, re, sys
root = sys.argv[1] if len(sys.argv) > 1 else '.'
docs = os.path.join(root, 'docs')
arch = open(os.path.join(docs, 'architecture.md')).read()
table = arch.split('## Stages: docs, code, test, benchmark', 1)[1].split('\n## ', 1)[0]
link = re.compile(r'\]\(([^)#]+)(?:#[^)]*)?\)')
bad = 0
rows = 0
for line in table.splitlines():
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) != 5 or cells[0] in ('stage', '---') or cells[0].startswith('---'):
        continue
    stage, doc, code, test, bench = cells
    pages = link.findall(doc)
    if not pages:
        continue
    rows += 1
    page = os.path.normpath(os.path.join(docs, pages[0]))
    text = open(page).read()
    text = re.sub(r'```.*?```', '', text, flags=re.S)  # code blocks and spans are not links
    text = re.sub(r'`[^`\n]*`', '', text)
    have = {os.path.normpath(os.path.join(docs, t)) for t in link.findall(text)}
    for kind, cell in (('code', code), ('test', test), ('benchmark', bench)):
        targets = [os.path.normpath(os.path.join(docs, t)) for t in link.findall(cell)]
        if not targets and cell not in ('—', '-'):
            print(f'{stage}: {kind} cell has no link: {cell}'); bad += 1
        for t in targets:
            if not os.path.exists(t):
                print(f'{stage}: {kind} {os.path.relpath(t, root)} does not exist'); bad += 1
            if t not in have:
                print(f'{os.path.relpath(page, root)} ({stage}): no link to its {kind} {os.path.relpath(t, root)}'); bad += 1
    for t in have:
        if not os.path.exists(t):
            print(f'{os.path.relpath(page, root)}: broken link {os.path.relpath(t, root)}'); bad += 1
print(f'{rows} stage rows checked, {bad} missing or broken links')
sys.exit(1 if bad else 0)
