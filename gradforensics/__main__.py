"""``python -m gradforensics`` (and ``torchrun --nproc-per-node R -m gradforensics capture ...``)."""

import sys

from gradforensics.cli import main

__all__: list[str] = []


if __name__ == "__main__":
    sys.exit(main())
