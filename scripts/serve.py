"""`rollout-serve` from a checkout: `python scripts/serve.py [group.key=value ...]`."""

import sys
from pathlib import Path

# Python puts this directory first on sys.path, where scripts/rollout.py would shadow the `rollout` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from rollout.cli.serve import main  # noqa: E402

if __name__ == "__main__":
    main()
