import sys

from pulsescale.entry import main

sys.exit(main())
