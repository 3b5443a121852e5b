"""`python -m localpd.cli`: the `localpd` command."""

import sys

from localpd.cli.main import main

sys.exit(main())
