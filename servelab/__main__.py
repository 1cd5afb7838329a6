import sys

from servelab.cli import main

sys.exit(main())
