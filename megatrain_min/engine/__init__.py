"""engine/ -- what stream.Trainer is handed, and a plan spelled as its arguments.

The package
    homes.py (where each unit lives: Homes), resident.py (a unit kept on the GPU), gpu_update.py (a
    streamed unit updated there), activations.py (the boundary activations in host memory:
    HostRing), tiling.py (a layer a tile of tokens at a time), sharded.py (N ranks), guard.py
    (non-finite steps skipped), lion.py (the Lion update rule), pinned.py (page-locked host memory
    of exactly the size asked), checks.py (every input check; CheckedTrainer), reference.py (the
    plain PyTorch oracle), lazy_init.py (initial weights a unit at a time). Not here: the engine
    itself (stream.py), the store and AdamW (optim.py), the flags (cli.py), the plan (plan/).
This file
    parts(offload, guarded, tile_tokens, resident_units, gpu_updated_units): the objects that plain
    settings mean -- where the boundary activations live (activations.HostRing, or None:
    stream.OnDevice), the non-finite guard (guard.Guard), the layer's functions (tiling.Tiled, or
    the model itself), where each unit lives (homes.Homes: resident on the GPU, streamed and updated
    there, or -- None -- every unit streamed). arguments(p): every keyword of stream.Trainer that a
    plan decides -- the dtypes, the memory mode, micro-batches, clipping, the loss chunk, the
    gradient slabs, the update rule (RULES, with its own defaults), and the parts. train.py, the
    stream checker and the twin (megatrain_min/sim/__init__.py) build the engine with them; the
    optimizer's hyper-parameters (lr, weight decay) come from the caller.
What it is not
    No decisions: the plan (megatrain_min/plan) made them; this only spells them as the engine takes
    them.
Try it
    python -c "from megatrain_min import engine; print(engine.parts(offload=True, tile_tokens=32))"
"""
import torch

import model
import optim
import stream
from megatrain_min.engine.activations import HostRing
from megatrain_min.engine.guard import Guard
from megatrain_min.engine.homes import Homes
from megatrain_min.engine.lion import Lion
from megatrain_min.engine.tiling import Tiled

# the dtypes (--dtype, --residual-dtype, --save-hf-dtype) and update rules (--optimizer) by the
# flags' names: what a plan spells (each rule with its own defaults)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
RULES = {"adamw": optim.AdamW, "lion": Lion}


def parts(offload=False, guarded=False, tile_tokens=0, resident_units=0, gpu_updated_units=0):
    """What the engine is handed: the boundary activations' store (offload: activations.HostRing,
    else on the device), a guard.Guard (guarded), the layer (tiling.Tiled(tile_tokens), or the
    model), the units' homes (homes.Homes(resident_units, gpu_updated_units); none: streamed)."""
    kept = resident_units or gpu_updated_units
    return dict(activations=HostRing() if offload else None, guard=Guard() if guarded else None,
                layer=Tiled(tile_tokens) if tile_tokens else model,
                homes=Homes(resident_units, gpu_updated_units) if kept else None)


def arguments(p, betas=None):
    """stream.Trainer's keyword arguments for plan p (megatrain_min.plan.plan): everything but the
    optimizer's hyper-parameters; its update rule takes betas (None: the rule's own). Without
    deferred updates the slabs are the plan's; with them the engine keeps a gradient store and its
    slab count is unused (stream.GRAD_SLABS)."""
    return dict(dtype=DTYPES[p["dtype"]], residual_dtype=DTYPES[p["residual_dtype"]],
                mode=p["mode"], micro_batches=p["micro_batches"], grad_clip=p["grad_clip"],
                chunk_tokens=p["chunk_tokens"], grad_slabs=p["grad_slabs"] or stream.GRAD_SLABS,
                rule=RULES[p["optimizer"]](*([tuple(betas)] if betas else [])),
                **parts(p["offload_activations"], p["skip_nonfinite"], p["tile_tokens"],
                        p["resident_units"], p["gpu_updated_units"]))
