"""launch.py -- N ranks on this machine from one command, every input checked before the first rank starts.

What it is
    `python train.py --nproc-per-node N ...` is `torchrun --standalone --nproc-per-node N train.py ...` with the
    refusals in front: train.py checks the flags for N ranks, the model, the plan for N GPUs, the data and the
    run directory in this one process first -- a bad input is one line and exit 2, and no rank ever starts --
    then ranks() runs train.py on N local ranks through torch.distributed's own launcher (elastic_launch, what
    torchrun runs) and leaves with the documented exit code of the rank that failed first (torchrun itself
    exits 1 whatever happened, after a report of its own). A SIGTERM, SIGHUP or Ctrl-C reaches the ranks, which
    save at the end of their step and exit; then so does this process, with 0.
What it is not
    Not a transport and not a scheduler: torch.distributed moves the bytes, its elastic agent starts and watches
    the ranks. One node; for several, torchrun on each node (README: more than one GPU).
"""
import logging
import os
import sys
import uuid

import torch

from megatrain_min import checks, rundir

EXIT_OF_SIGNAL = 128   # a rank killed by signal s: exit 128 + s, as a shell reports it
SHUTDOWN_S = 600       # between a SIGTERM here and SIGKILL of the ranks: time for a large model's save (the
                       # environment's rundir.SHUTDOWN_ENV wins; torchrun's own default is 30 s)


def without(argv, flag):
    """argv without `flag VALUE` or `flag=VALUE` (argparse's abbreviations of it too)."""
    out, skip = [], False
    for a in argv:
        name = a.split("=", 1)[0]
        if skip:
            skip = False
        elif len(name) > 2 and name.startswith("--") and flag.startswith(name):
            skip = "=" not in a
        else:
            out.append(a)
    return out


def check(device, n):
    """checks.check_device for n local ranks, and the shutdown wait: ValueError (one line) unless, with CUDA, this
    machine shows n GPUs, one per rank (torchrun finds that out only in the ranks), and rundir.SHUTDOWN_ENV is
    unset or a whole number of seconds. Returns the torch.device."""
    try:
        dev, wait = checks.check_device(device), os.environ.get(rundir.SHUTDOWN_ENV, str(SHUTDOWN_S))
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None
    if dev.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"--nproc-per-node {n} but this machine shows {torch.cuda.device_count()} CUDA devices; "
                         f"one rank per GPU: --nproc-per-node {torch.cuda.device_count()}, or --device cpu")
    if not wait.isdigit():
        raise ValueError(f"{rundir.SHUTDOWN_ENV}={wait!r}: seconds between a SIGTERM and SIGKILL of the ranks, a "
                         f"whole number; unset it for {SHUTDOWN_S}")
    os.environ[rundir.SHUTDOWN_ENV] = wait   # the ranks read it (rundir.shutdown_s), the launcher below too
    return dev


def ranks(n, argv):
    """Run `python -u train.py argv` on n local ranks (torchrun --standalone's settings); return the exit code:
    0 when every rank finished (or stopped on a signal after saving), else the code the first failing rank
    exited with -- its one line already on stderr. argv: train.py's flags without --nproc-per-node."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):   # quiet: the ranks say what went wrong, in one line
        if name.startswith("torch.distributed.elastic"):    # (each module's logger has its own level)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # as torchrun: N ranks share this machine's cores
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          shutdown_timeout=int(os.environ[rundir.SHUTDOWN_ENV]))
    try:
        elastic_launch(config, sys.executable)("-u", *argv)
        return 0
    except SignalException:          # the ranks got the signal too, saved and left (train.py: exit 0)
        return 0
    except ChildFailedError as e:
        codes = {r: f.exitcode for r, f in e.failures.items()}
        named = sorted(r for r, c in codes.items() if c > 0)   # rank 0 first: it says the refusals
        if named:
            return codes[named[0]]
        first, failure = e.get_first_failure()                  # killed by a signal, with no word
        print(f"error: rank {first} was killed (signal {-failure.exitcode}); the other ranks stopped",
              file=sys.stderr)
        return EXIT_OF_SIGNAL - failure.exitcode
