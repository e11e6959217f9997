"""``python -m mxc`` = the ``mxc`` command."""

import sys

from mxc.cli import main

sys.exit(main())
