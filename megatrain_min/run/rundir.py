"""rundir.py -- a training run's output directory: nothing lost, one line per refusal.

What it is
    Run(args) owns --out (and --save-hf) for train.py:
      check()     before anything is allocated: no other run holds --out's lock, every place the run
                  writes to is writable, an export never replaces what is not an earlier export
                  and is of a model its architecture represents (hf.architecture), the
                  disk holds a checkpoint (12 B/param) and the export; --resume reads the
                  checkpoint's meta.json (its tokenizer files verified) and refuses other settings.
                  The data's samplers are wrapped: a data file found damaged while training
                  (prepared.TokenFile: truncated, bit rot) ends the run with one line naming it and
                  the last checkpoint, exit 2
      claim()     the run lock (runlock.py: one run per --out; the kernel drops it even on SIGKILL),
                  and a new run never writes into a directory that holds another run's files
      record()    config.json (the resolved settings) written atomically; on --resume metrics.jsonl
                  is cut to the checkpoint's step by a new file renamed over it; then one flushed
                  line per step (log)
      save()      a checkpoint (megatrain_min/checkpoints/checkpoint.py), its failures turned into
                  exit codes
      stops       a stops.Stops: SIGTERM, SIGHUP, the first Ctrl-C: finish the step, save, exit 0
      count_skip(), stop_if_diverged()
                  a step the guard skipped, recorded and said; --max-skips in a row: exit 3
      profiler()  --profile: a torch.profiler trace of steps 2-4 into trace.json (close() ends it)
      export_hf() --save-hf: the final weights as a transformers directory
    Every refusal goes through exits.fail: one line, an exit code of exits.EXIT (0 done or stopped
    after a save, 2 bad input, 3 diverged, 4 an output not written, 5 a rank lost, 130 interrupted;
    README: Troubleshooting).
"""
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import torch
from tqdm import tqdm

from megatrain_min import cli, hf
from megatrain_min.checkpoints import checkpoint, ckpt_read
from megatrain_min.data import prepared
from megatrain_min.hf import load as hf_load
from megatrain_min.run import launch, runlock
from megatrain_min.run import stops
from megatrain_min.run.exits import EXIT, fail, state

SAME_RUN = ("batch_size", "seq_len", "micro_batches", "lr", "warmup", "weight_decay", "grad_clip",
            "seed", "data", "init_from", "chat_format", "optimizer", "betas")
NAME_MAX, PATH_MAX = 255, 4096   # bytes of one path component, of a whole path (Linux)


def same(flag, then, now, fingerprinted):
    """Is a SAME_RUN flag's value at the checkpoint the same setting as now? The data is compared by
    its fingerprint when the checkpoint has one (whatever the path's spelling); a model directory by
    where it is."""
    if flag == "data" and fingerprinted:
        return True
    if flag == "init_from" and then and now and os.path.exists(then) and os.path.exists(now):
        return os.path.samefile(then, now)
    return then == now


def settings_then(args):
    """The SAME_RUN settings a checkpoint was made with (args: its meta's flags). A flag its meta
    does not hold -- added since -- had its default (cli.DEFAULTS), or, with no default there, is
    "(not recorded)": a refusal names the flag, never a KeyError."""
    then = {k: args.get(k, cli.DEFAULTS.get(k, "(not recorded)")) for k in SAME_RUN}
    if then["betas"] is None:   # made before --betas was recorded: its update rule's own
        then["betas"] = cli.betas_of(then["optimizer"])
    return then


def as_typed(value):
    """A flag's value as it is typed: a list space-separated ("0.9 0.95")."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value


def check_path(path, flag):
    """fail unless path can name a file on Linux: no component longer than NAME_MAX bytes, at most
    PATH_MAX bytes in all, and not a symbolic link to nothing."""
    full = os.fsencode(os.path.abspath(path))
    long = next((c for c in full.split(b"/") if len(c) > NAME_MAX), None)
    if long is not None or len(full) >= PATH_MAX:
        what = (f"a component of {len(long)} bytes (at most {NAME_MAX})" if long is not None else
                f"{len(full):,} bytes long (at most {PATH_MAX - 1})")
        fail(f"{flag}: the path is {what}; pick a shorter one")
    if Path(path).is_symlink() and not Path(path).exists():
        fail(f"{flag} {path} is a symbolic link to {os.readlink(path)}, which does not exist; make "
             "its target, or pass another path")


def writable(path, flag):
    """The nearest existing directory at or above `path`; fail unless this process may create files
    there."""
    base = path
    while not base.exists() and not base.is_symlink():
        base = base.parent
    if not base.is_dir():
        fail(f"{flag} {path}: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        fail(f"{flag} {path}: {base} is not writable by this user")
    return base


def write_atomically(path, text):
    """Replace path by a file holding text: a new file, fsynced, renamed over it (a crash leaves old
    or new)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


class Run:
    def __init__(self, args, rank=0, world=1, gpus=1):
        self.a, self.rank, self.world, self.gpus = args, rank, world, gpus
        self.out = Path(args.out)
        self.hf_dir = Path(args.save_hf) if args.save_hf else None
        self.run_id, self.start_step, self.val_loss, self.skips = uuid.uuid4().hex[:12], 0, None, 0
        self.resume_from, self.metrics = None, None
        self.stops = stops.Stops(self.out, rank, world, gpus)   # signals: save, then exit
        self.fingerprint, self.hf_state = None, None  # of the data; of what --save-hf would replace
        self.lock = None                              # the run lock's open file (claim)
        self.prof = None                              # --profile: the profiler (profiler)

    # ----------------------------------------------------------------- before anything is allocated
    def check(self, cfg, n_params, init_dir, source):
        """Every output writable, the export target ours to replace, the disk big enough; --resume's
        checkpoint of this model made with these settings and this data (source: corpus.Source; its
        sampler position and the RNG restored into source.train and the generators)."""
        a, out, hf_dir = self.a, self.out, self.hf_dir
        # from here a rank may find what the others do not (its disk, its device)
        state["quiet"] = False
        self.fingerprint = source.fingerprint
        source.train, source.val = _Sampler(source.train, self), _Sampler(source.val, self)
        for flag, path in (("--out", out), ("--save-hf", hf_dir)):
            if path is not None:
                check_path(path, flag)
        holder = runlock.lock_holder(out) if self.rank == 0 else None
        if holder is not None:      # a live run (the ranks of a killed launcher, say) writes there
            fail(f"--out {out} is in use by another run (pid {holder}); wait for it to finish (or "
                 f"stop it: kill -TERM {holder}), or pass another --out")
        out_base = writable(out, "--out")
        if a.resume:              # its meta.json now (cheap); its weights once the engine exists
            if a.engine != "stream":
                fail("--resume needs --engine stream (the reference engine keeps no "
                     "host store to checkpoint)")
            self.resume_from = ckpt_read.latest(out) if a.resume == "latest" else Path(a.resume)
            if self.resume_from is not None and self.resume_from.is_file():
                fail(f"--resume {a.resume} is a file; --resume takes a checkpoint directory" + (
                    f": --resume {self.resume_from.parent}"
                    if ckpt_read.is_checkpoint(self.resume_from.parent) else ""))
            if self.resume_from is None and (out / "config.json").is_file():
                fail(f"--resume: {out} holds a run that stopped before its first checkpoint: "
                     f"nothing to resume. To start over, remove {out}/config.json and "
                     f"{out}/metrics.jsonl (or pass another --out)")
            if self.resume_from is None:
                fail(f"--resume: no checkpoint in {out}; run without --resume to "
                     "start, or pass --resume DIR")
            self._resume(cfg, source.train, init_dir)
        hf_base = None
        if hf_dir is not None:
            # what is there now (--nproc-per-node: at the launch), before it is checked: the
            # export replaces only that
            self.hf_state = launch.export_state(hf_dir)
            try:
                hf.check_export_dir(hf_dir)
                hf.architecture(cfg)       # a model transformers cannot represent: refused now
            except hf_load.HFError as e:
                fail(f"--save-hf: {e}")
            if hf_dir.resolve() == out.resolve() or hf_dir.resolve() in out.resolve().parents:
                fail(f"--save-hf {hf_dir} holds --out {out}; an export replaces its whole "
                     "directory: put it beside the run")
            if hf_dir.resolve() in (Path.cwd(), *Path.cwd().parents):
                fail(f"--save-hf {hf_dir} is the current directory (or holds it); an export "
                     f"replaces its whole directory: name a new one, e.g. --save-hf {out}-hf")
            if init_dir is not None and hf_dir.resolve() == init_dir.resolve():
                fail(f"--save-hf {hf_dir} is the --init-from directory; the export would replace "
                     "the model this run starts from")
            hf_base = writable(hf_dir.parent, "--save-hf")
        # free disk per filesystem: one checkpoint (old ones go only after it is whole), the export
        need = {}
        for base, n in ((out_base, 12 * n_params if a.engine == "stream" else 0),
                        (hf_base,
                         n_params * {"bf16": 2, "fp32": 4}[a.save_hf_dtype] if hf_dir else 0)):
            if n:
                dev_base, had = need.get(os.stat(base).st_dev, (base, 0))
                need[os.stat(base).st_dev] = (dev_base, had + n)
        for base, n in need.values():
            if (free := shutil.disk_usage(base).free) < n:
                fail(f"{base} has {free / 1e9:.2f} GB free; this run writes {n / 1e9:.2f} "
                     "GB there (a checkpoint is 12 B/param, --save-hf 2 or 4). Free some "
                     "space, or write elsewhere")

    def _resume(self, cfg, batches, init_dir):
        a, path = self.a, self.resume_from
        try:
            doc = ckpt_read.read_meta(path)     # its tokenizer files verified: its copy is intact
            ck = doc["meta"]
            ours = path / "tokenizer.json"
            theirs = init_dir / "tokenizer.json" if init_dir else None
            if theirs is not None and ours.is_file() and theirs.is_file() and \
                    ours.read_bytes() != theirs.read_bytes():
                fail(f"--resume: {theirs} is not the tokenizer {path.name} was trained with (its "
                     f"copy is {ours}); resume with the model directory the run started from")
            was = ck.get("data_fingerprint")  # the data: its content decides, not how it is spelled
            then = settings_then(ck["args"])
            changed = [k for k in SAME_RUN if not same(k, then[k], vars(a)[k], was is not None)]
            if changed:    # before the model's check: a missing --init-from makes another model
                flags = ', '.join(f"--{k.replace('_', '-')} {as_typed(then[k])}" for k in changed)
                fail(f"--resume: {path.name} was made with other settings ({flags}); pass the same "
                     "flags to continue bit-exactly")
            ckpt_read.check_model(path, doc, cfg)
            if was is not None and was != self.fingerprint:
                other = "" if was["bytes"] != self.fingerprint["bytes"] else ", other content"
                fail(f"--resume: the data changed since {path.name} was saved "
                     f"({a.data or 'the shipped corpus'}: {was['bytes']:,} bytes then, "
                     f"{self.fingerprint['bytes']:,} now{other}); "
                     "resume on the same data, or start a new run in another --out")
            self.run_id, self.start_step, self.val_loss = ck.get("run"), doc["step"], ck["val_loss"]
            self.skips = int(ck["skips"])
            batches.load_state_dict(ck["data"])
            checkpoint.set_rng_state(ck["rng"])
        except ckpt_read.CheckpointError as e:
            fail(str(e))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
            # an edited meta.json
            fail(f"--resume: {path}/meta.json does not hold what train.py saves "
                 f"({type(e).__name__}: {e})")
        if self.start_step >= a.steps:
            fail(f"--resume: {path.name} is at step {self.start_step}, already >= --steps "
                 f"{a.steps}; raise --steps to train on")

    def release(self):
        """Let go of the run lock (train.py --nproc-per-node: rank 0 takes it again)."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def load(self, trainer, init_dir):
        """Into the trainer: --resume's checkpoint (weights, Adam's moments and step counts), else
        the weights of
        --init-from when it is one of our checkpoints (Adam starts fresh). A checkpoint that fails
        its checks: one line, naming the checkpoint before it (often intact) to resume from
        instead."""
        path = self.resume_from or init_dir
        if path is None:
            return
        if (path / "meta.json").is_file():  # ours (a Hugging Face model's weights made the trainer)
            try:   # --init-from: the weights alone (whatever update rule saved them)
                checkpoint.load(trainer, path, weights_only=self.resume_from is None)
            except ckpt_read.CheckpointError as e:
                before = ckpt_read.before(path) if self.resume_from else None
                fail(f"{e}" + (f"; the checkpoint before it may be intact: --resume {before}"
                               if before else ""))
            if self.resume_from is None:   # --init-from: the weights only
                trainer.wait()
                trainer.opt.reset()
                trainer.lanes.synchronize()   # the step counts on the GPU zeroed before any lane
        print(f"resumed from {path} at step {self.start_step}" if self.resume_from else
              f"initialised from {path}")

    def claim(self):
        """The run lock (rank 0 holds it for the run: its ranks write their checkpoint parts there
        too), and no file of another run in --out: a new run never writes where another one did."""
        out = self.out
        try:
            # held until this process ends
            self.lock = runlock.lock(out) if self.rank == 0 else None
            out.mkdir(parents=True, exist_ok=True)       # (rank 0 made it in lock(), maybe not yet)
            # the lock file may exist already: can we create files?
            probe = out / f".probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except runlock.LockError as e:
            fail(f"{e}; wait for it to finish, or pass another --out")
        except OSError as e:
            fail(f"--out {out}: cannot write there ({e.strerror})")
        for p in (out / "config.json", out / "metrics.jsonl"):
            if p.exists() and not p.is_file():
                fail(f"--out {out}: {p.name} is not a file (a directory?); the run writes its "
                     "record there: move it away, or pass another --out")
        broken = sorted(p.name for p in out.glob("ckpt-*")
                        if ckpt_read.NAME.fullmatch(p.name) and not (p / "meta.json").is_file())
        if broken:
            fail(f"--out {out}: {broken[0]} is not a finished checkpoint (no meta.json: "
                 f"damaged, or copied incompletely); move it out of {out} (nothing there is "
                 "deleted), then run again")
        held = [p for p in (out / "config.json", out / "metrics.jsonl") if p.is_file()] + \
            [p for _, p in ckpt_read.checkpoints(out)] if self.rank == 0 else []
        for p in held:  # under the lock: nobody else writes here now
            try:
                owner = (json.loads(p.read_text()).get("run") if p.name == "config.json" else
                         ckpt_read.read_meta(p, tokenizer=False)["meta"].get("run")
                         if p.name.startswith("ckpt-") else self.run_id)
            except (OSError, ValueError, AttributeError):
                owner = "unknown"
            if not self.a.resume or owner != self.run_id:
                fail(f"--out {out} holds {'another' if self.a.resume else 'a'} run "
                     f"({p.name}); continue it with --resume, or pass a fresh --out "
                     "(nothing here is overwritten)")

    # ------------------------------------------------------------------ while training
    def record(self, settings):
        """config.json (the resolved settings), metrics.jsonl cut to the checkpoint's step on
        --resume, then open for one flushed line per step. Rank 0 keeps the record."""
        if self.rank:
            return
        out = self.out
        try:
            write_atomically(out / "config.json",
                             json.dumps({"run": self.run_id, **settings}, indent=2) + "\n")
            # keep the lines up to the checkpoint
            if self.a.resume and (out / "metrics.jsonl").exists():
                kept = []
                for line in (out / "metrics.jsonl").read_text(errors="replace").splitlines():
                    try:
                        if json.loads(line)["step"] <= self.start_step:
                            kept.append(line + "\n")
                    except (ValueError, KeyError, TypeError):  # a line torn by a kill
                        pass
                write_atomically(out / "metrics.jsonl", "".join(kept))
            self.metrics = open(out / "metrics.jsonl", "a")
        except OSError as e:
            fail(f"could not write the run record in {out} ({e.strerror}: "
                 f"{e.filename})", EXIT["write_failed"])

    def log(self, rec):
        """One line of metrics.jsonl, flushed (rank 0). Strict JSON: a non-finite number is null,
        and the line says "nonfinite": true."""
        if self.metrics is None:
            return
        rec, nonfinite = cli.finite_json(rec)   # strict JSON: a NaN loss is null, and flagged
        if nonfinite:
            rec["nonfinite"] = True
        try:
            self.metrics.write(json.dumps(rec, allow_nan=False) + "\n")
            self.metrics.flush()
        except OSError as e:
            fail(f"could not write {self.out / 'metrics.jsonl'} ({e.strerror}); the last "
                 f"checkpoint is {ckpt_read.latest(self.out) or 'none'}", EXIT["write_failed"])

    def save(self, trainer, step, state, tokenizer_from=None):
        """checkpoint.save of the trainer at `step`, with train.py's state (the data sampler's, the
        RNG's, the flags') and the tokenizer files of `tokenizer_from` (the model directory the run
        started from); a non-finite master: exit 3, a write error: exit 4. Under torchrun the first
        save says how long it took: a stop on SIGTERM must save within torchrun's
        --shutdown-timeout."""
        t0 = time.time()
        meta = {"run": self.run_id, "args": vars(self.a), "skips": self.skips,
                "val_loss": self.val_loss,
                "data_fingerprint": self.fingerprint, **state}
        try:
            path = checkpoint.save(trainer, self.out, step, meta, keep=self.a.keep,
                                   tokenizer_from=tokenizer_from)
            self.stops.saved(path)
        except checkpoint.NonFiniteError as e:
            fail(f"{e}; the last good checkpoint is "
                 f"{ckpt_read.latest(self.out) or 'none'}. Try a lower --lr",
                 EXIT["diverged"])
        except checkpoint.SaveError as e:
            fail(f"{e}. Free space (or fix the permission), then continue with "
                 "--resume", EXIT["write_failed"])
        except ckpt_read.CheckpointError as e:
            # its name taken by a directory that is not this run's
            fail(f"{e}; the last checkpoint is "
                 f"{ckpt_read.latest(self.out) or 'none'}", EXIT["write_failed"])
        self.stops.timed(time.time() - t0, path.name)
        return path

    def count_skip(self, rec, guard, loss):
        """The guard's verdict on step rec["step"] (guard.report): a skip goes into rec and is said
        on its own line; the steps skipped in a row are counted (checkpoints keep the count)."""
        skipped, said = guard.report(rec["step"], loss) if guard is not None else (None, None)
        self.skips = self.skips + 1 if skipped else 0
        if skipped:
            rec["skipped"] = skipped
            tqdm.write(said)

    def stop_if_diverged(self):
        """--max-skips steps skipped in a row: exit 3, naming the last good checkpoint."""
        if self.skips >= self.a.max_skips:
            fail(f"{self.skips} consecutive steps had a non-finite loss or gradient; stopping. Last"
                 f" good checkpoint: {ckpt_read.latest(self.out) or 'none'}. Try a lower --lr or "
                 f"--grad-clip 1.0.", EXIT["diverged"])

    def close(self):
        """metrics.jsonl closed; --profile: the profiler stopped, its trace written and named."""
        if self.metrics is not None:
            self.metrics.close()
        if self.prof is not None:
            self.prof.stop()
            print(f"profile: {self.out / 'trace.json'} (open in https://ui.perfetto.dev)")

    # ----------------------------------------------------------------- while training and after it
    def profiler(self, device):
        """--profile: torch.profiler, started, over steps 2-4 (step 1 allocates and warms up) and
        every thread's ops (the optimizer thread's too); the trace lands in trace.json."""
        tp = torch.profiler
        cuda = [tp.ProfilerActivity.CUDA] if device.type == "cuda" else []
        trace = str(self.out / "trace.json")
        prof = tp.profile(activities=[tp.ProfilerActivity.CPU] + cuda,
                          schedule=tp.schedule(wait=1, warmup=0, active=3, repeat=1),
                          experimental_config=tp._ExperimentalConfig(profile_all_threads=True),
                          on_trace_ready=lambda p: p.export_chrome_trace(trace))
        prof.start()
        self.prof = prof
        return prof

    def export_hf(self, trainer, cfg, tokenizer_from):
        """--save-hf: the final weights as a transformers directory, written by rank 0 (torchrun:
        every rank calls it, the weights gather there). The directory changed during the run: exit
        2; it could not be written: exit 4; either way nothing there was replaced."""
        if self.world > 1:
            final = trainer.weights(to=0)
        elif self.a.engine == "stream":
            final = hf.MasterWeights(trainer)   # a tensor at a time: no second copy of the model
        else:
            final = trainer.weights()
        try:
            if self.rank == 0:
                hf.save_hf(cfg, final, self.hf_dir, dtype=cli.DTYPES[self.a.save_hf_dtype],
                           tokenizer_from=tokenizer_from, replaces=self.hf_state)   # as checked
        except hf_load.HFError as e:
            fail(f"--save-hf: {e}; the run's checkpoint is {ckpt_read.latest(self.out) or 'none'}")
        except OSError as e:
            fail(f"--save-hf {self.hf_dir}: could not write the export ({e.strerror}); nothing "
                 f"there was replaced, the run's checkpoint is "
                 f"{ckpt_read.latest(self.out) or 'none'}", EXIT["write_failed"])
        print(f"saved a Hugging Face checkpoint to {self.hf_dir} ({self.a.save_hf_dtype})")

    def data_failed(self, e):
        """A data file found damaged while training (truncated, bit rot): one line, exit 2."""
        last = ckpt_read.latest(self.out) or "none"
        fail(f"{e}; the run stops here, the last checkpoint is {last}: continue with --resume once "
             f"the data is whole")


class _Sampler:
    """A data sampler (data.Batches, data.SFTBatches) whose next() ends the run with one line
    (Run.data_failed) when its file turns out damaged under the run (prepared.PrepareError:
    truncated, an id beyond the largest); the rest (state_dict, its fields) is the sampler's own."""

    def __init__(self, sampler, run):
        self.sampler, self.run = sampler, run

    def next(self):
        try:
            return self.sampler.next()
        except prepared.PrepareError as e:
            self.run.data_failed(e)

    def __getattr__(self, name):
        return getattr(self.sampler, name)
