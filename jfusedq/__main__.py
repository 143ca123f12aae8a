import sys

from jfusedq.cli import main

sys.exit(main())
