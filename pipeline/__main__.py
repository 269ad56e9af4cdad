"""``python -m pipeline``: the same command table as the ``pipeline`` script."""

from pipeline.cli import main

raise SystemExit(main())
