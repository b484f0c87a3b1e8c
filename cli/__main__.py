import sys

from gpudra.cli.main import main

sys.exit(main())
