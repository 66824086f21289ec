"""`python -m borrowd.controller` runs the borrowd CLI."""

import sys

from borrowd.controller.cli import main

sys.exit(main())
