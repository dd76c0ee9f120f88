"""`python -m kvscope` is the `kvscope` command."""
import sys

from kvscope.main import main

sys.exit(main())
