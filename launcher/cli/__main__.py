"""`python -m launcher.cli`: the fractus-pod command."""

import sys

from launcher.cli.main import main

sys.exit(main())
