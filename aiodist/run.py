"""``python -m aiodist.run``: the same as the ``aiodist-run`` command."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
