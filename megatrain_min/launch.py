"""launch.py -- N ranks on this machine from one command, every input checked before the first rank starts.

What it is
    `python train.py --nproc-per-node N ...` is `torchrun --standalone --nproc-per-node N train.py ...` with the
    refusals in front. train.py's checks (the flags for N ranks, the model, the plan for N GPUs, the data, the
    run directory) run first in a child process (checks_then_ranks): a bad input is one line and exit 2, and no
    rank ever starts. This process, alive for the whole run, never touches CUDA (the plan reads GPU memory, and
    a CUDA context would hold GPU 0's memory until the end). Then ranks() runs train.py on N local ranks through
    torch.distributed's own launcher (elastic_launch, what torchrun runs) and exits with the documented code of
    the rank that failed (torchrun itself exits 1 whatever happened, after a report of its own).
Signals
    A SIGTERM, SIGHUP, SIGQUIT or Ctrl-C here is passed on to every rank, as torchrun does, and this process
    waits for them: on SIGTERM, SIGHUP or a first Ctrl-C they save at the end of their step and exit 0; a
    second Ctrl-C stops them at once (130); a save that fails gives 4. The exit code says what they did.
What it is not
    Not a transport and not a scheduler: torch.distributed moves the bytes, its elastic agent starts and watches
    the ranks. One node; for several, torchrun on each node (README: more than one GPU). As with torchrun, a
    SIGKILL here leaves the ranks running (each in a session of its own): stop them with SIGTERM.
"""
import glob
import logging
import os
import signal
import sys
import threading
import uuid
import warnings

import torch

from megatrain_min import checks, rundir

EXIT_OF_SIGNAL = 128   # a rank killed by signal s: exit 128 + s, as a shell reports it
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)   # torchrun's default set


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
    """checks.check_device for n local ranks: ValueError (one line) unless, with CUDA, this machine shows n GPUs,
    one per rank (torchrun finds that out only in the ranks). Returns the torch.device."""
    try:
        dev = checks.check_device(device)
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None
    if dev.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"--nproc-per-node {n} but this machine shows {torch.cuda.device_count()} CUDA devices; "
                         f"one rank per GPU: --nproc-per-node {torch.cuda.device_count()}, or --device cpu")
    return dev


def _children():
    """The pids of this process's children (the ranks, started by the agent's thread): Linux's /proc."""
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def _pass_on(pids, passed=None):
    """A signal handler that sends the signal it got to pids() (processes already gone are skipped), noting it
    in the list `passed`."""
    def handler(sig, _frame):
        if passed is not None:
            passed.append(sig)
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return handler


def checks_then_ranks(n, argv):
    """In the parent: fork; wait for the child, which runs train.py's checks and leaves at hand_over; exit with
    its code when it refused, else start the ranks and exit with theirs. In the child: return, output quiet but
    errors (no warnings). argv: train.py's flags without --nproc-per-node."""
    sys.stdout.flush(), sys.stderr.flush()
    child = os.fork()
    if child == 0:   # rank 0 prints what this would, warnings included
        sys.stdout = open(os.devnull, "w")
        warnings.simplefilter("ignore")
        return
    for s in PASSED_ON:
        signal.signal(s, _pass_on(lambda: [child]))
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    sys.exit((EXIT_OF_SIGNAL - code if code < 0 else code) or ranks(n, argv))


def hand_over(run):
    """In the checks' child, once every input is good: release the run directory's lock and leave, exit 0."""
    run.release()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)   # the parent starts the ranks; nothing of this process may run at exit (no second lock file)


def ranks(n, argv):
    """Run `python -u train.py argv` on n local ranks (torchrun --standalone's settings) and return the exit
    code: 0 when every rank exited 0 (finished, or stopped by a signal after a save), else the code of the
    rank that failed -- a rank killed by a signal first (named here: 128 + the signal), then a rank's own code
    other than 5 (its one line already on stderr), else 5."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):   # quiet: the ranks say what went wrong, in one line
        if name.startswith("torch.distributed.elastic"):    # (each module's logger has its own level)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # as torchrun: N ranks share this machine's cores
    os.environ[rundir.LAUNCHED_ENV] = "1"           # the ranks say what a signal to this process does
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    codes, passed = {}, []

    def agent():
        try:
            elastic_launch(config, sys.executable)("-u", *argv)
        except ChildFailedError as e:
            codes.update({r: f.exitcode for r, f in e.failures.items()})
        except BaseException as e:          # the launcher itself failed (a rendezvous that never formed)
            codes[-1] = e

    # The agent runs on a thread of its own: off the main thread it installs no signal handlers, so this one
    # passes every signal on and keeps each rank's exit code (the agent's own handler would end the run as
    # "stopped by a signal" whatever the ranks did).
    for s in PASSED_ON:
        signal.signal(s, _pass_on(_children, passed))
    thread = threading.Thread(target=agent, name="elastic-agent")
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if -1 in codes:
        print(f"error: could not start the ranks ({codes[-1]}); try torchrun --standalone --nproc-per-node {n}",
              file=sys.stderr)
        return rundir.EXIT["rank_lost"]
    killed = sorted(r for r, c in codes.items() if c < 0)
    if killed:    # by a signal passed on from here (the user's: no word), or from elsewhere (named)
        if -codes[killed[0]] not in passed:
            print(f"error: rank {killed[0]} was killed (signal {-codes[killed[0]]}); the other ranks stopped",
                  file=sys.stderr)
        return EXIT_OF_SIGNAL - codes[killed[0]]
    own = sorted(r for r, c in codes.items() if c != rundir.EXIT["rank_lost"])   # rank 0 first: the refusals
    return codes[own[0]] if own else (rundir.EXIT["rank_lost"] if codes else 0)
