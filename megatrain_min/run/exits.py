"""exits.py -- how a training process ends on an error, and which rank of a run it is.

What it is
    fail(msg, code) is the one way out of train.py on an error: one line on stderr ("error: ",
    "rank N: " under torchrun), an exit code of EXIT, the codes' one home (README: Troubleshooting):
        0 done, or stopped by a signal after a save; 2 bad input, refused before anything is
        trained, nothing lost (or a data file found damaged while training); 3 training diverged
        (non-finite steps in a row, or non-finite weights, which are never saved); 4 an output
        could not be written (disk full, file too large, no permission), every earlier checkpoint
        whole; 5 under torchrun, another rank failed or was killed (torchrun itself exits 1 and
        names it); 130 Ctrl-C before the first step or a second one while training: out at once,
        no save.
    torchrun(): (rank, world, GPUs per node) from torchrun's environment, checked; a rank other
    than 0 prints nothing, and says no error every rank finds (state["quiet"]) until the run
    directory is checked (rundir.Run.check).
What it is not
    Not what a run writes or how it stops when asked: rundir.py (its output directory) and
    stops.py (signals, the ranks' agreement).
"""
import os
import sys
import warnings

EXIT = dict(done=0, bad_input=2, diverged=3, write_failed=4, rank_lost=5, interrupted=130)
# this process's rank under torchrun; quiet: a rank other than 0 while every rank finds the same
# errors
state = dict(rank=0, quiet=False)


def fail(msg, code=EXIT["bad_input"]):
    """One line on stderr and an exit code: 2 = bad input, refused before training, nothing
    half-written."""
    if not state["quiet"]:
        rank = state["rank"]
        sys.stderr.write("error: "
                         # one write: ranks interleave
                         f"{f'rank {rank}: ' if rank else ''}{msg}\n")
        sys.stderr.flush()
    sys.exit(code)


def torchrun():
    """(rank, world, gpus per node) of this process from torchrun's RANK, WORLD_SIZE and
    LOCAL_WORLD_SIZE (a plain run: 0, 1, 1), checked: one line and exit 2 when they are not what
    torchrun sets. A rank other than 0 prints nothing (its errors: fail) and, until the run
    directory is checked, says no error the others say."""
    env, names = os.environ, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    try:
        rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        gpus, local = int(env.get("LOCAL_WORLD_SIZE", world)), int(env.get("LOCAL_RANK", 0))
    except ValueError:
        fail(f"{', '.join(names)} must be integers (torchrun sets them); launch with torchrun, or "
             "unset them for a plain run")
    missing = [k for k in names + ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if world > 1 and missing:
        fail(f"WORLD_SIZE={world} but {', '.join(missing)} not set: that is not a torchrun "
             f"launch; launch with torchrun --nproc-per-node {world} train.py ..., or unset "
             "WORLD_SIZE for a plain run")
    if not (world >= 1 and 0 <= rank < world and 1 <= gpus <= world and world % gpus == 0 and
            (world == 1 or 0 <= local < gpus)):
        fail(f"RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}, LOCAL_WORLD_SIZE={gpus} do not "
             "describe a torchrun launch (0 <= RANK < WORLD_SIZE, a whole number of nodes of "
             "LOCAL_WORLD_SIZE ranks); launch with torchrun, or unset them for a plain run")
    state.update(rank=rank, quiet=rank > 0)
    if rank:
        sys.stdout = open(os.devnull, "w")   # only rank 0 prints, warnings too
        warnings.simplefilter("ignore")
    return rank, world, gpus
