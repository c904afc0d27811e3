"""python -m megatrain_min.chat MODEL_DIR DATA.jsonl [LINE]: the name the chat inspector is
documented by. It is megatrain_min/data/chat.py (main)."""
import sys

from megatrain_min.data.chat import main

if __name__ == "__main__":
    sys.exit(main())
