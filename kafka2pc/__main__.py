"""``python -m kafka2pc`` and the ``kafka2pc`` console script: the operator CLI.

The command needs click (``pip install 'kafka2pc[cli]'``).  Without it, this
entry point writes one line naming the extra to stderr and exits with status 1,
instead of a traceback.
"""

from __future__ import annotations

import importlib
import sys

from kafka2pc._extras import MissingExtraError

__all__ = ["main"]


def main() -> None:
    """Run the ``kafka2pc`` command line (:func:`kafka2pc.cli.main`)."""
    try:
        # By name: kafka2pc.cli lives in cli/ (package-dir), outside mypy's view of kafka2pc/.
        cli = importlib.import_module("kafka2pc.cli")
    except MissingExtraError as exc:
        sys.stderr.write(f"kafka2pc: {exc}\n")
        raise SystemExit(1) from None
    cli.main()


if __name__ == "__main__":
    main()
