"""Entry point of `python -m service` (see service/cli.py)."""

from service.cli import main

raise SystemExit(main())
