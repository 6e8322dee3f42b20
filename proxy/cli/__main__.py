"""`python -m proxy.cli`: the same as the `killick` command."""
import sys

from proxy.cli import main

sys.exit(main())
