"""``python -m labkit.cluster`` (under torchrun): see :mod:`labkit.cluster.cli`."""
import sys

from labkit.cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
