"""``python -m kvtier_runtime.replay``: the same command as ``kvtier replay``."""
import sys

from .cli import main

sys.exit(main())
