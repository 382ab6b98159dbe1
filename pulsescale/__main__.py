import sys

from pulsescale.cli import main

sys.exit(main())
