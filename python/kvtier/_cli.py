"""The ``kvtier`` console script: runs the CLI binary shipped inside the package."""

from __future__ import annotations

import os
import sys


def main() -> int:
    exe = os.path.join(os.path.dirname(__file__), "bin", "kvtier")
    if not os.path.exists(exe):
        sys.stderr.write(f"kvtier: the CLI binary is not in this installation ({exe}); "
                         "reinstall with KVTIER_PYTHON_CLI=ON\n")
        return 2
    os.execv(exe, [exe] + sys.argv[1:])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
