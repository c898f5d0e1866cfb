"""``python -m fx_passes run [options] -- script.py args...``: the launcher (see fx_passes.entry.launcher)."""

import sys

from fx_passes.entry.launcher import main

if __name__ == "__main__":
    sys.exit(main())
