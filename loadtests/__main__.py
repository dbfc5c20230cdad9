"""`python -m loadtests ...`: the load-test command line (see loadtests/cli.py)."""

from loadtests.cli import main

raise SystemExit(main())
