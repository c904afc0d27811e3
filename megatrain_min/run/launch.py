"""launch.py -- N ranks on this machine from one command, every input checked before the first rank
starts.

What it is
    `python train.py --nproc-per-node N ...` is `torchrun --standalone --nproc-per-node N train.py
    ...` with the refusals in front. train.py's checks (the flags for N ranks, the model, the plan
    for N GPUs, the data, the run directory) run first in a child process (checks_then_ranks): a bad
    input is one line and exit 2, and no rank ever starts. This process, alive for the whole run,
    never touches CUDA (the plan reads GPU memory, and a CUDA context would hold GPU 0's memory
    until the end). Then ranks() runs train.py on N local ranks through torch.distributed's own
    launcher (elastic_launch, what torchrun runs) and exits with the documented code of the rank
    that failed (torchrun itself exits 1 whatever happened, after a report of its own). What
    --save-hf holds is taken before the checks (EXPORT_STATE_ENV, export_state): the ranks start
    seconds later, and an export that lands meanwhile is another run's, never replaced.
Signals
    A SIGTERM, SIGHUP, SIGQUIT or Ctrl-C here is passed on to every rank, as torchrun does, and this
    process waits for them: on SIGTERM, SIGHUP or a first Ctrl-C they save at the end of their step
    and exit 0; a second Ctrl-C stops them at once (130); a save that fails gives 4. The exit code
    says what they did (outcome(): a rank's own failure first -- the agent then stops the others
    with SIGTERM, which is no news).
A rank that stops answering
    Each rank beats (heartbeat(): a thread that touches a file of its own every HEARTBEAT_S / 6 s).
    A rank whose process stops running -- SIGSTOP, a paused container or VM, a process frozen whole
    -- is silent there; after HEARTBEAT_S seconds of silence (60 by default; HEARTBEAT_ENV sets it)
    this process names the rank, ends the run (SIGKILL to every rank: a checkpoint being written
    stays a .tmp-* directory, every finished one whole) and exits 5. HEARTBEAT_ENV is checked
    before any rank starts: not a number of seconds > 0 is refused in one line (exit 2), below
    HEARTBEAT_LEAST (5 s) it is raised to that, with a warning. Without this the other ranks
    wait in a collective for torch's timeout (10 minutes), then the agent waits 30 s more for the
    frozen one. A rank alive but stuck in one call (a hung kernel) still beats: the collective
    timeout catches it.
What it is not
    Not a transport and not a scheduler: torch.distributed moves the bytes, its elastic agent starts
    and watches the ranks. One node; for several, torchrun on each node (README: more than one GPU).
    As with torchrun, a SIGKILL here leaves the ranks running (each in a session of its own): stop
    them with SIGTERM.
"""
import glob
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

import torch

from megatrain_min import hf
from megatrain_min.checkpoints import ckpt_read
from megatrain_min.engine import checks
from megatrain_min.run import exits, stops

EXIT_OF_SIGNAL = 128   # a rank killed by signal s: exit 128 + s, as a shell reports it
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's default set
HEARTBEAT_S = 60                              # seconds of silence: a rank has stopped answering
HEARTBEAT_ENV = "MEGATRAIN_MIN_HEARTBEAT_S"   # ... when set here (a test: a few seconds)
# the least silence taken for a frozen rank: a healthy rank on a loaded machine may miss a beat of a
# second or so (its thread not scheduled); a smaller HEARTBEAT_ENV is raised to this, with a warning
HEARTBEAT_LEAST = 5
BEATS_ENV = "MEGATRAIN_MIN_BEATS"             # where the ranks beat (set for them by ranks())
EXPORT_STATE_ENV = "MEGATRAIN_MIN_EXPORT_STATE"   # what --save-hf held at the launch (export_state)


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


def check(device, n, present=True):
    """checks.check_device for n local ranks: ValueError (one line) unless, with CUDA, this machine
    shows n GPUs, one per rank (torchrun finds that out only in the ranks). present=False: planned
    for, not run here.
    Returns the torch.device."""
    try:
        dev = checks.check_device(device, present)
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None
    if dev.type == "cuda" and present and torch.cuda.device_count() < n:
        raise ValueError(f"--nproc-per-node {n} but this machine shows {torch.cuda.device_count()} "
                         "CUDA devices; one rank per GPU: --nproc-per-node "
                         f"{torch.cuda.device_count()}, or --device cpu")
    return dev


def _children():
    """The pids of this process's children (the ranks, started by the agent's thread): Linux's
    /proc."""
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def _pass_on(pids, passed=None):
    """A signal handler that sends the signal it got to pids() (processes already gone are skipped),
    noting it in the list `passed`."""
    def handler(sig, _frame):
        if passed is not None:
            passed.append(sig)
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return handler


def checks_then_ranks(n, argv, out, save_hf=None):
    """In the parent: fork; wait for the child, which runs train.py's checks and leaves at
    hand_over; exit with its code when it refused, else start the ranks and exit with theirs. In the
    child: return, output quiet but errors (no warnings). argv: train.py's flags without
    --nproc-per-node; out: its --out; save_hf: its --save-hf, whose export_state is taken now, for
    the ranks (they start seconds later: an export that lands meanwhile is another run's, and wins).
    First, HEARTBEAT_ENV checked (check_heartbeat)."""
    check_heartbeat()
    if save_hf:
        try:
            os.environ[EXPORT_STATE_ENV] = json.dumps(hf.export_state(save_hf))
        except OSError:        # unreadable: the checks below say so (the ranks never start)
            pass
    sys.stdout.flush(), sys.stderr.flush()
    child = os.fork()
    if child == 0:   # rank 0 prints what this would, warnings included
        sys.stdout = open(os.devnull, "w")
        warnings.simplefilter("ignore")
        return
    for s in PASSED_ON:
        signal.signal(s, _pass_on(lambda: [child]))
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    sys.exit((EXIT_OF_SIGNAL - code if code < 0 else code) or ranks(n, argv, out))


def export_state(hf_dir):
    """hf.export_state(hf_dir): as the launcher saw it before any rank started (EXPORT_STATE_ENV,
    set by checks_then_ranks), else now."""
    if EXPORT_STATE_ENV in os.environ:
        return json.loads(os.environ[EXPORT_STATE_ENV])
    return hf.export_state(hf_dir)


def hand_over(run):
    """In the checks' child, once every input is good: release the run directory's lock and leave,
    exit 0."""
    run.release()
    sys.stdout.flush(), sys.stderr.flush()
    # the parent starts the ranks; nothing of this process may run at exit (no second lock file)
    os._exit(0)


def heartbeat_s():
    """HEARTBEAT_S, or HEARTBEAT_ENV's seconds, at least HEARTBEAT_LEAST. ValueError (one line)
    when HEARTBEAT_ENV is set to anything but a finite number of seconds > 0."""
    raw = os.environ.get(HEARTBEAT_ENV)
    if raw is None:
        return HEARTBEAT_S
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not (math.isfinite(wait) and wait > 0):
        raise ValueError(f"{HEARTBEAT_ENV}={raw!r} is not a number of seconds > 0 (how long a rank "
                         f"may be silent before the run is ended); set it to {HEARTBEAT_LEAST} or "
                         f"more, or unset it for {HEARTBEAT_S}")
    return max(wait, HEARTBEAT_LEAST)


def check_heartbeat():
    """Before any rank starts: exits.fail (one line, exit 2) for a HEARTBEAT_ENV heartbeat_s()
    refuses; a warning when it raises one below HEARTBEAT_LEAST."""
    try:
        wait = heartbeat_s()
    except ValueError as e:
        exits.fail(str(e))
    if HEARTBEAT_ENV in os.environ and wait > float(os.environ[HEARTBEAT_ENV]):
        warnings.warn(f"{HEARTBEAT_ENV}={os.environ[HEARTBEAT_ENV]} is below the least silence "
                      f"taken for a frozen rank: {HEARTBEAT_LEAST} s is used (a healthy rank on a "
                      "busy machine may miss a beat that short)")


def heartbeat(rank):
    """In a rank started by ranks() (BEATS_ENV set): write this process's PID to BEATS/RANK, then
    touch it every heartbeat_s() / 6 seconds from a daemon thread, for as long as the process runs.
    Elsewhere: nothing."""
    beats = os.environ.get(BEATS_ENV)
    if not beats:
        return
    path, every = Path(beats) / str(rank), heartbeat_s() / 6

    def beat():
        while True:
            try:
                os.utime(path)
            except OSError:            # the launcher went away and took the directory with it
                return
            time.sleep(every)
    path.write_text(str(os.getpid()))
    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def silent(beats, wait, now=None):
    """(rank, pid, seconds) of the live rank that has been silent longest, if more than `wait`
    seconds, else None. beats: the directory where the ranks beat; a rank that has not beaten yet is
    not judged (torch's rendezvous times out on a rank that never joins), nor one that exited
    (Linux's /proc says which)."""
    now, worst = time.time() if now is None else now, None
    for f in Path(beats).iterdir():
        try:
            quiet, pid = now - f.stat().st_mtime, int(f.read_text() or 0)
            with open(f"/proc/{pid}/stat") as st:           # "pid (comm) S ...": its state
                gone = st.read().rsplit(")", 1)[1].split()[0] in "ZXx"
        except (OSError, ValueError, IndexError):           # no such process any more: it exited
            continue
        if quiet > wait and not gone and (worst is None or quiet > worst[2]):
            worst = (int(f.name), pid, quiet)
    return worst


def outcome(codes, passed):
    """(exit code, the line to say or None) of a launch from the ranks' exit codes ({rank: code};
    -s: killed by signal s) and the signals passed on from here. A rank's own failure (refused,
    diverged, a write error, a second Ctrl-C: its one line already said) comes first: the agent then
    stops the others with SIGTERM, which is no news. Else a rank killed by a signal not passed on
    from here is named (128 + s; a SIGTERM last, being the agent's), one killed by a signal passed
    on from here is not; else 5 (another rank was lost), or 0."""
    own = sorted(r for r, c in codes.items() if c > 0 and c != exits.EXIT["rank_lost"])
    if own:
        return codes[own[0]], None
    killed = sorted((r for r, c in codes.items() if c < 0),
                    key=lambda r: (codes[r] == -signal.SIGTERM, r))
    if killed:
        r, sig = killed[0], -codes[killed[0]]
        said = f"rank {r} was killed (signal {sig}); the other ranks stopped"
        return EXIT_OF_SIGNAL + sig, None if sig in passed else said
    return (exits.EXIT["rank_lost"] if codes else 0), None


def ranks(n, argv, out=None):
    """Run `python -u train.py argv` on n local ranks (torchrun --standalone's settings) and return
    the exit code (outcome()): 0 when every rank exited 0 (finished, or stopped by a signal after a
    save), else the code of the rank that failed; 5 with one line naming it when a rank stopped
    answering (heartbeat_s() of silence: the run is ended). out: --out, for the line's last
    checkpoint."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # quiet: the ranks say what went wrong, in one line
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):  # (each module's logger has its own level)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks share this machine's cores
    os.environ[stops.LAUNCHED_ENV] = "1"   # the ranks say what a signal to this process does
    beats = os.environ[BEATS_ENV] = tempfile.mkdtemp(prefix="megatrain-min-beats-")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    codes, passed = {}, []

    def agent():
        try:
            elastic_launch(config, sys.executable)("-u", *argv)
        except ChildFailedError as e:
            codes.update({r: f.exitcode for r, f in e.failures.items()})
        except BaseException as e:     # the launcher itself failed (a rendezvous that never formed)
            codes[-1] = e

    # The agent runs on a thread of its own: off the main thread it installs no signal handlers, so
    # this one passes every signal on and keeps each rank's exit code (the agent's own handler would
    # end the run as "stopped by a signal" whatever the ranks did).
    for s in PASSED_ON:
        signal.signal(s, _pass_on(_children, passed))
    thread = threading.Thread(target=agent, name="elastic-agent")
    thread.start()
    frozen, wait = None, heartbeat_s()
    while thread.is_alive():
        thread.join(0.1)
        if frozen is None and (frozen := silent(beats, wait)):   # end the run: every rank, at once
            for pid in _children():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    shutil.rmtree(beats, ignore_errors=True)
    if frozen:
        last = ckpt_read.latest(out) if out else None
        print(f"error: rank {frozen[0]} (pid {frozen[1]}) stopped answering: no heartbeat for "
              f"{frozen[2]:.0f} s (a frozen process: SIGSTOP, a paused VM); the run was "
              f"ended, every finished checkpoint is whole (the last: {last or 'none'}); "
              "continue with --resume",
              file=sys.stderr)
        return exits.EXIT["rank_lost"]
    if -1 in codes:
        print(f"error: could not start the ranks ({codes[-1]}); try torchrun --standalone "
              f"--nproc-per-node {n}",
              file=sys.stderr)
        return exits.EXIT["rank_lost"]
    code, line = outcome(codes, passed)
    if line:
        print(f"error: {line}", file=sys.stderr)
    return code
