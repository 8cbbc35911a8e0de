#!/usr/bin/env python3
"""The house rules for the code under crates/*/src, measured:
- no source file over 1,000 lines, test modules (`#[cfg(test)] mod`) left out;
- no function outside test modules over 120 lines.
Prints each breach and exits 1 if there is one. `--top N` lists the N longest
files and functions whatever their size."""
import glob
import re
import sys

MAX_FILE = 1000
MAX_FN = 120


def blank_literals(src):
    """`src` with comments, strings and char literals replaced by spaces (new
    lines kept), so braces can be matched by counting."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:i + 10]) and not (i and (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'r(#*)"', src[i:])
            end = '"' + m.group(1)
            j = src.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'\n])'", src[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(text, open_at):
    """Index just past the brace matching the `{` at `open_at`."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def measure(path):
    src = open(path, encoding="utf-8").read()
    text = blank_literals(src)
    line_of = lambda k: text.count("\n", 0, k) + 1
    test_spans = []
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", text):
        test_spans.append((m.start(), block_end(text, m.end() - 1)))
    in_test = lambda k: any(a <= k < b for a, b in test_spans)
    test_lines = sum(line_of(b) - line_of(a) + 1 for a, b in test_spans)
    lines = src.count("\n") - test_lines
    fns = []
    for m in re.finditer(r"\bfn\s+(\w+)[^;{]*?\{", text):
        if in_test(m.start()):
            continue
        # `fn` types inside signatures (fn(u8) -> u8) have no name: skipped by \w+.
        end = block_end(text, m.end() - 1)
        fns.append((line_of(end) - line_of(m.start()) + 1, m.group(1), line_of(m.start())))
    return lines, fns


def main():
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 0
    files, fns, bad = [], [], 0
    for path in sorted(glob.glob("crates/*/src/**/*.rs", recursive=True)):
        lines, f = measure(path)
        files.append((lines, path))
        fns.extend((n, f"{path}:{line} {name}") for n, name, line in f)
    for lines, path in sorted(files, reverse=True):
        if lines > MAX_FILE:
            print(f"file over {MAX_FILE} lines (tests left out): {path} {lines}")
            bad += 1
    for n, where in sorted(fns, reverse=True):
        if n > MAX_FN:
            print(f"function over {MAX_FN} lines: {where} {n}")
            bad += 1
    if top:
        print(f"\nlongest files (tests left out):")
        for lines, path in sorted(files, reverse=True)[:top]:
            print(f"  {lines:5} {path}")
        print(f"longest functions:")
        for n, where in sorted(fns, reverse=True)[:top]:
            print(f"  {n:5} {where}")
    print(f"{bad} breaches")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
