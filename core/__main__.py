import sys

from blockforge.cli import main

sys.exit(main())
