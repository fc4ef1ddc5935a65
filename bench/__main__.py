"""`python -m bench [--quick] [--only NAME ...]`."""

from bench.run import main

raise SystemExit(main())
