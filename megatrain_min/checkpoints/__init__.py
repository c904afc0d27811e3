"""checkpoints/ -- a trainer saved and restored, bit for bit: checkpoint.py (save, load: atomic,
verified, streamed from the host store) and ckpt_read.py (the format; a checkpoint found, read and
verified without a trainer). Not here: a run's directory and when it saves (run/), Hugging Face
exports (hf/).
"""
