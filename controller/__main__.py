"""`python -m controller` runs the borrowd CLI."""

import sys

from controller.cli import main

sys.exit(main())
