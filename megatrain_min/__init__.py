"""megatrain_min: the supporting cast of megatrain-min, one concept per file.

data.py (bytes, corpus, batches), reference.py (the plain PyTorch oracle trainer), plan.py (memory and
throughput planner), checkpoint.py (save/resume), hf.py (Hugging Face import/export). The engine itself lives
at the top level: model.py, stream.py, optim.py, train.py; measurements live in bench/.
"""
