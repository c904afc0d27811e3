"""python -m megatrain_min.sim check|timeline (megatrain_min/sim/__init__.py: main)."""
import sys

from megatrain_min.sim import main

sys.exit(main())
