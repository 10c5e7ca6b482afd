"""`python -m cli ...`: ppd's command line without the installed `ppd` script (tests, scripts, a GPU
host)."""

import sys

from cli.main import main

sys.exit(main())
