"""train.py -- the script, top to bottom: flags -> model -> plan -> data -> run directory -> engine
-> loop -> checkpoints -> export and sample.

What it is
    The one command people run. `python train.py` trains the ~1M-parameter toy preset on the
    shipped Shakespeare bytes on whatever device there is (a few minutes on a 2-core laptop) and
    prints a sample; the same script plans and trains 7B-120B presets on one GPU with enough host
    RAM, and with --nproc-per-node N or under torchrun on N GPUs (megatrain_min/engine/sharded.py:
    each rank holds 1/N of the host store and computes B/N sequences of the same global batch).
What it is not
    No tensor or pipeline parallelism, no config files: a preset from model.PRESETS plus flags
    (megatrain_min/cli.py holds them and their defaults; `python train.py --help` lists them).
Try it
    python train.py                                  # toy, CPU or GPU
    python train.py --nproc-per-node 2 --batch-size 8 --micro-batches 2   # 2 ranks (or torchrun)
    python train.py --engine reference               # the plain PyTorch oracle: same losses on CPU
    python train.py --config 70b --plan --batch-size 4 --seq-len 4096  # the plan, nothing allocated
Every run writes OUT/config.json (the resolved settings) and OUT/metrics.jsonl (one object per
step); rank 0 alone prints and writes them; every rank writes its part of each checkpoint (one
filesystem). Exit codes (megatrain_min/run/exits.py): 0 done or stopped after a save, 2 bad input,
3 diverged, 4 an output not written, 5 a rank lost, 130 Ctrl-C before the first step, or twice.
"""
import argparse
import json
import signal
import sys
import time

from tqdm import tqdm

import model
from megatrain_min import cli, engine, plan
from megatrain_min.checkpoints import checkpoint, ckpt_read
from megatrain_min.cli import DTYPE_NAMES
from megatrain_min.data import corpus
from megatrain_min.engine import sharded
from megatrain_min.engine.checks import CheckedTrainer, check_device
from megatrain_min.engine.lazy_init import LazyInit
from megatrain_min.engine.reference import ReferenceTrainer
from megatrain_min.plan import fit, report
from megatrain_min.run import exits, inputs, launch, rundir, sample
from megatrain_min.run.exits import EXIT, fail
from megatrain_min.run.meter import Meter
from megatrain_min.run.schedule import lr_at

# --- flags ----------------------------------------------------------------------------------------
cli.survive_closed_pipe()               # `python train.py --plan --json | head`: no traceback
RANK, WORLD, GPUS = exits.torchrun()   # rank RANK of WORLD processes, GPUS per node; plain: 0 of 1
launch.heartbeat(RANK)                  # a rank of --nproc-per-node: the launcher sees it is alive
p = argparse.ArgumentParser(description="Train a GPT whose weights and optimizer live in host RAM.")
cli.add_model(p, config_default=False)   # no preset by default: --init-from may give the model
for add in (cli.add_step, cli.add_hardware, cli.add_run):
    add(p)
p.error = fail  # argparse's own complaints: one line and exit code 2 too
cli.warn_in_one_line()   # warnings: one line, like errors
untrained = "interrupted before the first step; nothing was trained"
signal.signal(signal.SIGINT, lambda *_: fail(untrained, EXIT["interrupted"]))
args = p.parse_args()
LAUNCH = args.nproc_per_node > 1 and WORLD == 1   # N ranks from here, all checked here first
if LAUNCH:   # the checks below run in a child (this process, the ranks' parent, never touches CUDA)
    WORLD = GPUS = args.nproc_per_node
    if not (args.plan or args.json or args.max_context):
        launch.checks_then_ranks(WORLD, launch.without(sys.argv, "--nproc-per-node"), args.out,
                                 args.save_hf)
try:
    cli.check(args, WORLD)
except cli.FlagError as e:
    fail(str(e))
args.betas = cli.betas_of(args.optimizer, args.betas)   # as trained: none given, the rule's own

# --- the model: a preset or --init-from, at --seq-len ---------------------------------------------
plan_only = args.plan or args.json or args.max_context
try:   # one of our checkpoints: its config now, its weights once the engine exists (run.load)
    cfg, init_dir, init_weights, tokenizer = inputs.model_from(args)
    cfg = inputs.seq_len_checked(args, cfg, plan_only)   # planning: any length; training: checked
except ValueError as e:  # HFError, CheckpointError, a config field GPTConfig lacks, --seq-len
    fail(str(e))
here = not plan_only or args.hardware == "local"   # planning for other hardware needs no GPU here
try:  # torchrun: this rank's GPU, made current before anything touches CUDA (else GPU 0)
    if LAUNCH:   # the N ranks to come: a GPU each
        device = launch.check(args.device, WORLD, here)
    else:
        device = sharded.rank_device(args.device) if WORLD > 1 else check_device(args.device, here)
except ValueError as e:
    fail(str(e) if LAUNCH else f"--device: {e}")
dtype, why = inputs.compute_dtype(args.dtype, device)
tokens_per_step, n_params = args.batch_size * args.seq_len, model.n_params(cfg)

# --- plan: will it fit, how fast ------------------------------------------------------------------
try:
    if plan_only:   # for --hardware; nothing is allocated
        local = args.hardware == "local"
        ranks = dict(gpus=GPUS, nodes=WORLD // GPUS) if WORLD > 1 else {}   # torchrun: the run's
        pl = plan.from_flags(args, cfg, name=args.config, device=device, **ranks,
                             dtype=args.dtype or (DTYPE_NAMES[dtype] if local else None))
        report.show(pl, args.json, args.max_context, cfg.max_seq_len)
        sys.exit(0)
    pl = plan.from_flags(args, cfg, "local", name=args.config, device=device, real=True,
                         gpus=GPUS, nodes=WORLD // GPUS, dtype=DTYPE_NAMES[dtype])
    if args.engine == "stream":  # refuse before anything is allocated
        fit.check(pl)
except ValueError as e:  # does not fit (and what would), an unknown --hardware
    fail(str(e))
print(f"config {args.config}: {n_params:,} params | {json.dumps(cfg.to_dict())}")
print(f"device {device} | compute dtype {str(dtype)[6:]} ({why}), {args.residual_dtype} residual | "
      f"engine {args.engine} | {tokens_per_step:,} tokens/step in {args.micro_batches} "
      f"micro-batch(es)")
print(report.describe_run(pl, WORLD, GPUS))

# --- data -----------------------------------------------------------------------------------------
try:   # a model that is not a byte model reads text through its own tokenizer
    needs_tokenizer = init_weights is not None or (init_dir is not None and cfg.vocab_size != 256)
    source = corpus.open_data(args.data, cfg, args.batch_size, args.seq_len, args.seed, tokenizer,
                              init_dir, args.chat_format, needs_tokenizer, args.sample_prompt)
except ValueError as e:
    fail(str(e))
print("\n".join(source.lines))

# --- the run directory, checked first -------------------------------------------------------------
run = rundir.Run(args, RANK, WORLD, GPUS)
run.check(cfg, n_params, init_dir, source)   # writable, disk space; --resume: its checkpoint
run.claim()                                         # the lock; no other run's files in --out
if LAUNCH:   # every input is good: the parent starts the ranks (this script, torchrun's env)
    launch.hand_over(run)

# --- weights and engine ---------------------------------------------------------------------------
if WORLD > 1:  # join the other ranks: NCCL, each rank on its GPU (cuda:LOCAL_RANK), or gloo on CPUs
    try:
        device = sharded.init_from_env(args.device)
    except ValueError as e:   # the other ranks never came
        fail(str(e))
    print(run.stops.describe(n_params, args.batch_size))   # the ranks, a checkpoint, a stop
weights = init_weights if init_weights is not None else LazyInit(cfg, seed=args.seed)  # per unit
hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
try:  # a tensor of --init-from that is not finite, say: one line naming it
    if args.engine == "stream":  # under torchrun rank r of N holds its shard of every unit
        Engine = sharded.ShardedTrainer if WORLD > 1 else CheckedTrainer   # stream.Trainer, checked
        trainer = Engine(cfg, weights, device=device, **hyper, **engine.arguments(pl, args.betas))
    else:
        trainer = ReferenceTrainer(cfg, weights, device=device, dtype=dtype, **hyper,
                                   betas=tuple(args.betas), grad_clip=args.grad_clip,
                                   micro_batches=args.micro_batches)
except (ValueError, TypeError) as e:
    fail(f"{init_dir or 'weights'}: {e}")
del weights  # the engine holds its own copy (the host store)
run.load(trainer, init_dir)   # --resume: its checkpoint; --init-from a checkpoint: its weights


def evaluate():
    """Mean val loss over --eval-batches fixed batches (the same ones at every evaluation)."""
    state = source.val.state_dict()
    losses = [trainer.evaluate(*source.val.next()) for _ in range(args.eval_batches)]
    source.val.load_state_dict(state)
    return sum(losses) / len(losses)


def save(step_done):
    if args.engine == "stream":
        state = {"data": source.train.state_dict(), "rng": checkpoint.rng_state()}
        return run.save(trainer, step_done, state, tokenizer_from=init_dir if tokenizer else None)


# --- the loop -------------------------------------------------------------------------------------
run.stops.catch()    # SIGTERM, SIGHUP, a first Ctrl-C: finish the step, save, exit 0
run.record({"args": vars(args), "model": cfg.to_dict(), "params": n_params, "device": str(device),
            "dtype": str(dtype), "mode": pl["mode"], "world_size": WORLD,   # config.json, metrics
            "resident_units": pl["resident_units"], "gpu_updated_units": pl["gpu_updated_units"]})
meter = Meter(cfg, pl, tokens_per_step, trainer, WORLD)   # tokens/s, TFLOP/s, MFU, traffic
guard = trainer.guard
bar = tqdm(range(run.start_step, args.steps), desc="train", dynamic_ncols=True,
           disable=True if RANK else None, initial=run.start_step, total=args.steps)
prof = run.profiler(device) if args.profile else None   # steps 2-4: trace.json
for step in bar:
    lr = lr_at(step, args.lr, args.steps, warmup=args.warmup)
    trainer.set_lr(lr)
    x, y = source.train.next()
    meter.start()
    loss = trainer.step(x, y)
    if guard is not None and not trainer.defer_updates:
        trainer.wait()  # updates run as gradients land: a unit's verdict is known once done
    rec = meter.record(step + 1, loss, lr)
    run.count_skip(rec, guard, loss)   # a skipped step: in rec, said, counted
    if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
        run.val_loss = rec["val_loss"] = evaluate()
        tqdm.write(f"step {step + 1}: train loss {loss:.4f}  val loss {run.val_loss:.4f}")
    run.log(rec)
    bar.set_postfix(meter.postfix(rec))
    if prof is not None:
        prof.step()
    run.stop_if_diverged()   # --max-skips steps skipped in a row: exit 3
    stop = run.stops.agree(trainer)   # a signal may reach the ranks in different steps: all agree
    if stop or step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0:
        path = save(step + 1)
        if stop:
            print(f"stopped at step {step + 1}; checkpoint {path}; continue with --resume")
            sharded.leave()                      # every rank is here: the group goes cleanly
            sys.exit(EXIT["done"])
bar.close()
run.close()   # --profile: the trace written
last = ckpt_read.latest(run.out) if args.engine == "stream" else "none (reference engine)"
took = time.time() - meter.started
print(f"done: {args.steps} steps in {took:.0f}s, final val loss {run.val_loss:.4f} (nats/token), "
      f"checkpoint {last}")

# --- export and sample ----------------------------------------------------------------------------
if run.hf_dir is not None:  # torchrun: a collective; the model lands on rank 0 alone, to write
    run.export_hf(trainer, cfg, tokenizer_from=init_dir)
sample.closing(cfg, trainer, source, args.sample_tokens, window=args.seq_len, seed=args.seed,
               rank=RANK, world=WORLD)   # torchrun: a collective, rank 0 prints
sharded.leave()   # N ranks: the process group, destroyed while Python is whole
