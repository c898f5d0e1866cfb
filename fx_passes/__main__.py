"""``python -m fx_passes run [options] -- script.py args...``: the launcher (see fx_passes.cli)."""

import sys

from fx_passes.cli import main

if __name__ == "__main__":
    sys.exit(main())
