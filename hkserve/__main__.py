"""`python -m hkserve ...` is the `hkserve` command."""

import sys

from hkserve.cli.main import main

sys.exit(main())
