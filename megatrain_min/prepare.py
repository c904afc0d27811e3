"""python -m megatrain_min.prepare: the name the prepare command is documented by. The command is
megatrain_min/data/prepare.py (main)."""
import sys

from megatrain_min.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
