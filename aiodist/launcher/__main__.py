"""``python -m aiodist.launcher``: the same as the ``aiodist-run`` command."""

import sys

from . import main

sys.exit(main())
