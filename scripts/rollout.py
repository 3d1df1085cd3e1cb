"""The main job (rollout/job/main.py): ``python scripts/rollout.py [group.key=value ...]``."""

import sys
from pathlib import Path

# Python puts this directory first on sys.path, where this file would shadow the `rollout` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from rollout.job.main import main  # noqa: E402

if __name__ == "__main__":
    main()
