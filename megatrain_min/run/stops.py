"""stops.py -- how a training run stops when asked: signals, the ranks' agreement, a lost rank.

What it is
    Stops(out, rank, world, gpus), held by rundir.Run (run.stops) for train.py:
      catch()       SIGTERM, SIGHUP, the first Ctrl-C: finish the step, save, exit 0; a second
                    Ctrl-C: out at once, exit 130 (once the stop's checkpoint is written -- saved()
                    -- a second Ctrl-C changes nothing: the run is leaving). Under torchrun a
                    collective that failed because another rank went away is one line and exit 5;
                    torchrun then names the rank that failed first.
      agree(trainer)  whether to stop after this step: a signal may reach the ranks in different
                    steps (or between this question and the answer); they agree on one value and
                    stop, and save, together.
      timed(took, name)  under torchrun, the first save says how long it took: a stop on SIGTERM
                    must save within torchrun's --shutdown-timeout (shutdown_s()).
      describe(n_params, batch_size)  rank 0's line: the ranks and their share of a step, what a
                    checkpoint writes per node, and the SIGTERM window.
What it is not
    Not the launcher's side -- passing a signal on to every rank, naming a frozen one: launch.py.
    Signal handlers run on the main thread only (Python's rule), between two bytecodes: a stop is
    a request that the training loop acts on at the end of its step.
"""
import math
import os
import signal
import sys

import torch.distributed as dist
from tqdm import tqdm

from megatrain_min.checkpoints import ckpt_read
from megatrain_min.run.exits import EXIT

# torchrun's default wait between its SIGTERM to the ranks and SIGKILL (--shutdown-timeout)
SHUTDOWN_S = 30
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"   # that wait when set here (torchrun reads it)
LAUNCHED_ENV = "MEGATRAIN_MIN_LAUNCHED"   # set for ranks started by launch.py, which waits for them


def shutdown_s():
    """Seconds between a SIGTERM to the launcher (torchrun, launch.py) and its SIGKILL of the ranks,
    as far as a rank can see: SHUTDOWN_ENV when it is a whole number, else torchrun's default."""
    wait = os.environ.get(SHUTDOWN_ENV, "")
    return int(wait) if wait.isdigit() else SHUTDOWN_S


class Stops:
    def __init__(self, out, rank=0, world=1, gpus=1):
        self.out, self.rank, self.world, self.gpus = out, rank, world, gpus
        self.requested, self.agreed = [], False          # signals; this step ends the run
        self.saved_at, self.timed_once = None, False      # the stop's checkpoint

    def catch(self):
        """SIGTERM, SIGHUP or the first Ctrl-C: finish the step, save, exit (self.requested holds
        the signal); a second Ctrl-C interrupts at once."""
        def request_stop(signum, frame):
            if self.saved_at is not None:   # the stop's checkpoint is written: the run is leaving
                return
            if self.requested and signum == signal.SIGINT:
                print("error: interrupted twice: exiting now without a save; the last checkpoint "
                      f"is {ckpt_read.latest(self.out) or 'none'}", file=sys.stderr)
                # where the main thread is: a save cleans up after itself
                raise SystemExit(EXIT["interrupted"])
            self.requested.append(signum)
            tqdm.write(f"signal {signal.Signals(signum).name}: saving at the end of "
                       "this step, then exiting")
        # SIGHUP: the terminal or ssh went away
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, request_stop)
        if self.world > 1:
            sys.excepthook = self._rank_lost

    def saved(self, path):
        """A checkpoint was written: the stop's when the ranks agreed to stop after this step (not a
        periodic save during which a signal came: the run trains one more step)."""
        self.saved_at = path if self.agreed else None

    def _rank_lost(self, kind, e, tb):
        """Under torchrun: a collective that failed because another rank went away (killed, or
        failed) is one line and exit 5. Anything else: the traceback."""
        if not (isinstance(e, dist.DistError) or isinstance(e, RuntimeError) and "gloo" in str(e)):
            return sys.__excepthook__(kind, e, tb)
        print(f"error: rank {self.rank}: another rank stopped answering "
              f"({(str(e).splitlines() or [''])[0][:160]}); this rank stops too. The last "
              f"checkpoint is {ckpt_read.latest(self.out) or 'none'}",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT["rank_lost"])

    def agree(self, trainer):
        """Whether to stop after this step, the same answer on every rank."""
        if self.world == 1:
            self.agreed = bool(self.requested)
        else:
            mine = self.requested[0] if self.requested else None
            self.agreed = any(s is not None for s in trainer.placement.gather_object(mine))
        return self.agreed

    def timed(self, took, name):
        """Under torchrun (not launch.py, which waits), the first save's time, against the window
        between torchrun's SIGTERM and its SIGKILL."""
        wait = shutdown_s()
        if self.world > 1 and not self.timed_once and not os.environ.get(LAUNCHED_ENV):
            self.timed_once = True
            tqdm.write(f"checkpoint {name} took {took:.1f} s" + (
                f": more than half of the {wait} s torchrun waits between its SIGTERM and SIGKILL; "
                f"launch it with --shutdown-timeout {math.ceil(3 * took)} so that a stop can save "
                "(or train.py --nproc-per-node)"
                if took > wait / 2 else ""))

    def describe(self, n_params, batch_size):
        """The line torchrun's rank 0 prints: the ranks and their share of a step's batch_size
        sequences, what a checkpoint writes per node, and the SIGTERM window."""
        stop = ("A SIGTERM or Ctrl-C to train.py stops the ranks with a save; a second "
                "Ctrl-C at once, unsaved"
                if os.environ.get(LAUNCHED_ENV) else
                "A SIGTERM to torchrun stops the ranks with a save, and torchrun SIGKILLs them "
                f"{shutdown_s()} s later ({SHUTDOWN_ENV} or --shutdown-timeout): the first save "
                "says how long one takes")
        per_node = 12 * n_params / max(1, self.world // self.gpus) / 1e9
        ranks = (f"torchrun: {self.world} ranks, each holding 1/{self.world} of the host store and "
                 f"computing {batch_size // self.world} of the {batch_size} sequences of a step")
        return f"{ranks}; a checkpoint writes {per_node:.1f} GB per node. {stop}"
