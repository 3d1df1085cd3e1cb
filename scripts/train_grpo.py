"""`rollout-train-grpo` from a checkout: `python scripts/train_grpo.py [group.key=value ...]`."""

import os
import sys

# scripts/rollout.py is named like the package: look past this folder for `import rollout`.
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.dirname(os.path.realpath(__file__))]

from rollout.cli.train_grpo import main  # noqa: E402

if __name__ == "__main__":
    main()
