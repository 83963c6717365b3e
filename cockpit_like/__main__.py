"""``python -m cockpit_like ...`` runs the ``cockpit-like`` command line tool."""

import sys

from cockpit_like.cli import main

sys.exit(main())
