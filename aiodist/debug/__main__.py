"""``python -m aiodist.debug``: read flight-recorder dumps, or a running job's live view."""

from . import main

raise SystemExit(main())
