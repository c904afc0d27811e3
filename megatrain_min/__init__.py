"""megatrain_min: the periphery of megatrain-min, one concept per file, each readable alone.

The engine lives at the top level (model.py, stream.py, optim.py, train.py). Here are its variations
(tiling, activations, sharded, guard), its inputs and outputs (data, prepare, tokenizer, chat,
checkpoint, hf, rundir), its checks, its oracle (reference), the planner (plan, memory, cost) and
the instruments that prove the schedule on a CPU (record, race, twin, sim). docs/design.md, section
'Layout', says which file holds which concept; measurements live in bench/.
"""
