"""`python -m blockspec.services.cli`: the command line (how `serve` starts its role processes)."""

import sys

from blockspec.services.cli.main import main

sys.exit(main())
