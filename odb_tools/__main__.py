"""``python -m odb_tools``: the ``odb`` command."""

import sys

from odb_tools.cli import main

sys.exit(main())
