"""Run one page's code blocks in order, as a reader would paste them (a child process of test_code_blocks.py).

Usage: ``python _run_blocks.py BLOCKS.json``.  The file lists ``{"kind", "path", "line", "source"}``
in page order.  Python blocks share one namespace (a ``__main__`` module) and one event loop, and may
use top-level ``await`` as in ``python -m asyncio``; shell blocks run with ``bash -euo pipefail`` in
the same working directory and environment.  The first failing block ends the run with exit code 1
and a line ``FAILED <path>:<line>`` after its traceback; tracebacks carry the page's line numbers.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import subprocess
import sys
import time
import traceback
import types


def main(blocks_file: str) -> int:
    with open(blocks_file, encoding="utf-8") as f:
        blocks = json.load(f)
    module = types.ModuleType("__main__")
    sys.modules["__main__"] = module  # dataclasses, pickling and enums look their module up here
    namespace = module.__dict__
    loop = asyncio.new_event_loop()
    try:
        for block in blocks:
            where = f"{block['path']}:{block['line']}"
            started = time.monotonic()
            try:
                if block["kind"] == "python":
                    # Padding puts the block's first line on its line of the page.
                    source = "\n" * block["line"] + block["source"]
                    code = compile(source, block["path"], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
                    result = eval(code, namespace)  # noqa: S307 - the documentation's own code
                    if inspect.iscoroutine(result):
                        loop.run_until_complete(result)
                else:
                    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block["source"]], check=False)
                    if done.returncode != 0:
                        raise RuntimeError(f"the shell block exited with {done.returncode}")
            except BaseException:  # noqa: BLE001 - report which block failed, whatever it raised
                traceback.print_exc()
                print(f"FAILED {where}", file=sys.stderr, flush=True)
                return 1
            print(f"ran {where} in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
