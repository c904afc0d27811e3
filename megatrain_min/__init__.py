"""megatrain_min: the periphery of megatrain-min, one concept per file, each readable alone.

The engine lives at the top level (model.py, stream.py, optim.py, train.py). Here are its variations
(tiling, activations, sharded, guard), what it is handed for a run (engine), its inputs and outputs
(data, prepare, encode, prepared, corpus, tokenizer, chat, checkpoint, ckpt_read, hf, hf_load,
rundir, runlock), how a run ends (stops, exits, launch), its checks and flags (checks, cli), its
oracle (reference), the planner (the plan/ package: setting, hardware,
memory, timing, fit, report) and the instruments that prove the schedule on a CPU (record, cost,
race, twin, sim).
docs/design.md, section 'Layout', says which file holds which concept; measurements live in bench/.
"""
