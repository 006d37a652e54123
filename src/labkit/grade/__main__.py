"""``python -m labkit.grade``: the same as ``labkit-grade``."""
import sys

from labkit.grade.cli import main

sys.exit(main())
