"""`python -m tinylm` is the same as the `tinylm` command."""

from tinylm.cli import main

raise SystemExit(main())
