"""python -m megatrain_min.hf export CKPT DIR: one of our checkpoints as a Hugging Face directory
(megatrain_min/hf/__init__.py: main)."""
import sys

from megatrain_min.hf import main

sys.exit(main())
