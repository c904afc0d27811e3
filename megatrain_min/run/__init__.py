"""run/ -- a training run as train.py makes it: inputs.py (the model and sequence length the flags
name, resolved and checked), rundir.py (its output directory: config.json, metrics.jsonl,
checkpoints kept, skipped steps counted, the profile, the export), meter.py (what each step
measures: tokens/s, TFLOP/s, MFU, traffic), runlock.py (one run per directory), stops.py (a stop on
a signal: save, then exit), exits.py (the exit codes, the one-line refusal), launch.py
(--nproc-per-node: the ranks started, watched, their exit codes into one), schedule.py (the learning
rate), sample.py (text from trained weights). Not here: the checkpoint format (checkpoints/), the
flags (cli.py).
"""
