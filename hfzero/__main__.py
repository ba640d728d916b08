import sys

from hfzero.cli import main

sys.exit(main())
