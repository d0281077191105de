"""Regenerate data/tiny_corpus.txt: English prose from the docstrings of Python's standard library.

The default recipe needs a small real-text corpus that ships with the repo (no network at train time).
Docstrings of the standard library (PSF license) are plain English about programming, deterministic for
a given Python version, and easy to regenerate: `python scripts/make_corpus.py`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

MODULES = [
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "concurrent.futures",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "http.client",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "multiprocessing",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "platform",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shelve",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "turtle",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
]
LIMIT_BYTES = 900_000


def docstrings(module_name: str) -> list[str]:
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return []
    found = [inspect.getdoc(module) or ""]
    for _, member in sorted(vars(module).items()):
        if (inspect.isclass(member) or inspect.isfunction(member)) and getattr(
            member, "__module__", ""
        ) == module_name:
            found.append(inspect.getdoc(member) or "")
    return [d.strip() for d in found if len(d.strip()) > 80]


def main() -> None:
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for name in MODULES:
        for doc in docstrings(name):
            if doc in seen:
                continue
            seen.add(doc)
            encoded = len(doc.encode()) + 2
            if size + encoded > LIMIT_BYTES:
                break
            parts.append(doc)
            size += encoded
    out = Path(__file__).resolve().parent.parent / "data" / "tiny_corpus.txt"
    out.write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    print(f"wrote {out} ({size} bytes, {len(parts)} docstrings, Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
