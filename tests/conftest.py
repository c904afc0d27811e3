"""Make the repository root importable (model.py, stream.py, optim.py live there) and share helpers: random
batches, tiny tokenizers, a fast runner of train.py (TrainCLI) and the "nothing lost" check (assert_refused)."""
import atexit
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import model  # noqa: E402

# grouped-query attention, Qwen2 qkv bias, Qwen3 q/k norm with an explicit head_dim, tied embeddings
SPECIAL = model.GPTConfig(vocab_size=97, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=96, head_dim=32,
                          qkv_bias=True, qk_norm=True, tie_embeddings=True, max_seq_len=64)


def engine(cfg, weights, offload_activations=False, skip_nonfinite=False, tile_tokens=0, resident_units=0,
           gpu_updated_units=0, checked=True, **kw):
    """A trainer on `weights`, handed the objects that plain settings make (engine.parts: activations.HostRing,
    guard.Guard, tiling.Tiled, homes.Homes): checks.CheckedTrainer, every argument checked, or stream.Trainer
    itself (checked=False)."""
    import stream
    from megatrain_min.engine import checks
    from megatrain_min.engine import parts
    cls = checks.CheckedTrainer if checked else stream.Trainer
    handed = parts(offload_activations, skip_nonfinite, tile_tokens, resident_units, gpu_updated_units)
    return cls(cfg, weights, **{**handed, **kw})


def homed(t, kind):
    """The units of trainer t whose home is a `kind` (stream.Streamed, resident.Resident, gpu_update.GpuUpdated;
    exactly that class), sorted."""
    return sorted(u for u, home in enumerate(t.home) if type(home) is kind)


class ReferenceLion(torch.optim.Optimizer):
    """Lion written from its paper (Chen et al. 2023, Algorithm 2), plain PyTorch, one parameter at a time: the
    oracle of megatrain_min/engine/lion.py. For each parameter p with gradient g and moment m (zeros at first):
        c = beta1 * m + (1 - beta1) * g;  p = p - lr * (sign(c) + weight_decay * p);  m = beta2 * m + (1 - beta2) * g"""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = m.mul(beta1).add(p.grad, alpha=1 - beta1)      # beta1 m + (1 - beta1) g
                p.mul_(1 - lr * wd)
                p.add_(torch.sign(c), alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)          # beta2 m + (1 - beta2) g


def reference_lion(betas=(0.9, 0.99)):
    """ReferenceTrainer's optimizer= for a Lion run: ReferenceLion on its parameter groups."""
    return lambda groups, lr: ReferenceLion(groups, lr=lr, betas=betas)


def random_batch(cfg, B, T, gen, ignore_frac=0.2):
    """tokens, targets (B, T); a fraction of the targets set to -100."""
    tok = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt[torch.rand(B, T, generator=gen) < ignore_frac] = model.IGNORE
    return tok, tgt


# ----------------------------------------------------------------------------- comparisons that say what differs
# One home for the comparisons of an engine with its reference and of the model with transformers: a failure
# names the step, the tensor and the worst relative difference, beside the bound it broke. Each bound is set by
# its test at about 10x the difference measured on the dev machine, the measurement in a comment beside it;
# `python -m pytest -s` prints every measured difference ("measured ...").
def rel_diff(a, b):
    """max|a - b| / max|b| of two tensors (computed in float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def check_close(what, got, want, tol):
    """Tensors got vs want: rel_diff <= tol, else a failure naming `what` (e.g. "step 2: logits") and the worst
    element. Returns the relative difference."""
    r = rel_diff(got, want)
    print(f"measured {what}: {r:.2e} (bound {tol:.0e})")
    if r > tol:
        i = (got.detach().double() - want.detach().double()).abs().argmax()
        at = tuple(int(j) for j in torch.unravel_index(i, want.shape))
        raise AssertionError(f"{what}: max relative difference {r:.2e} > bound {tol:.0e} (max|a - b| / max|b|); "
                             f"worst element {list(at)}: {got[at].item():.6g} vs {want[at].item():.6g}")
    return r


def check_loss(step, got, want, tol, what="loss"):
    """One step's losses got (the engine's) vs want (the reference's): |got - want| / |want| <= tol, else a failure
    naming the step. Returns the relative difference."""
    r = abs(got - want) / abs(want)
    print(f"measured step {step} {what}: {r:.2e} (bound {tol:.0e})")
    if not r <= tol:
        raise AssertionError(f"step {step}: {what} {got!r} vs reference {want!r}: relative difference {r:.2e} > "
                             f"bound {tol:.0e}")
    return r


def losses_agree(a, b, cfg, gen, steps, B, T, rtol):
    """Step trainers a and b on the same random batches; every step's losses agree to rtol (check_loss)."""
    for s in range(steps):
        tok, tgt = random_batch(cfg, B, T, gen)
        check_loss(s, a.step(tok, tgt), b.step(tok, tgt), rtol)


def update_diffs(w0, wa, wb):
    """{key: (||(wa - w0) - (wb - w0)||^2, ||wb - w0||^2)} per tensor, in float64."""
    out = {}
    for k in wb:
        num = float(((wa[k].double() - wb[k].double()) ** 2).sum())
        den = float(((wb[k].double() - w0[k].double()) ** 2).sum())
        out[k] = (num, den)
    return out


def update_rel(w0, wa, wb):
    """||(wa - w0) - (wb - w0)|| / ||wb - w0|| over all tensors: how far two updates are apart."""
    d = update_diffs(w0, wa, wb)
    return (sum(n for n, _ in d.values()) / sum(s for _, s in d.values())) ** 0.5


def check_updates(when, w0, wa, wb, tol):
    """The updates wa - w0 (the engine's) and wb - w0 (the reference's) agree: update_rel <= tol, else a failure
    naming `when` (e.g. "after step 5"), the whole difference and the tensor that differs most (its own
    ||difference|| / ||update||). Returns update_rel."""
    d = update_diffs(w0, wa, wb)
    r = (sum(n for n, _ in d.values()) / sum(s for _, s in d.values())) ** 0.5
    print(f"measured {when} updates: {r:.2e} (bound {tol:.0e})")
    if not r <= tol:
        key = max(d, key=lambda k: d[k][0])
        own = (d[key][0] / d[key][1]) ** 0.5 if d[key][1] else float("inf")
        raise AssertionError(f"{when}: weight updates differ by {r:.2e} relative (||difference|| / ||update||, "
                             f"all tensors) > bound {tol:.0e}; most of it in {key}: {own:.2e} of its own update")
    return r


SPLIT = {  # the split regexes of the published tokenizer.json files (Llama 3 groups up to 3 digits, Qwen2 none)
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def make_bpe_tokenizer(directory, texts, vocab_size, special_tokens, tokenizer_config, style="gpt2",
                       added_tokens=()):
    """A tiny BPE tokenizer trained here on `texts`, saved as directory/tokenizer.json with a
    tokenizer_config.json (nothing is downloaded). Returns the tokenizers.Tokenizer.
    style: the pipeline of a published family, so that transformers 5 (whose Qwen2Tokenizer and
    LlamaTokenizer rebuild it rather than read it from tokenizer.json) tokenizes like the file:
    "gpt2" byte-level; "llama3" and "qwen2" byte-level after the family's split regex (and NFC for Qwen2);
    "sentencepiece" (Llama 2, Mistral) spaces as U+2581, one before the text, unknown characters -> the
    first special token. added_tokens: added, not special (Qwen3's <think>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    if style == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token=special_tokens[0], fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])            # as the published files
        alphabet = sorted(set("".join(texts)))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if style in SPLIT:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(SPLIT[style]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if style == "qwen2":
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                                       initial_alphabet=alphabet))
    tok.add_tokens(list(added_tokens))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tok


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ----------------------------------------------------------------------------- train.py as a user runs it, fast
# Every `python train.py ...` pays ~3 CPU-seconds importing torch before it looks at a flag, and ~0.5 s more
# planning (the planner traces a layer of the config under FakeTensorMode). TrainCLI pays both once: a helper
# process imports train.py's dependencies and makes the traces the runs ask most (the toy's, 7b's; a test adds
# its own configs' with cli.trace), where that starts no thread (cached by config; fake tensors, so nothing is
# computed and no OpenMP team exists yet: forking it is safe), then forks one fresh child per run. The child
# runs train.py (or another script, or `python -m module`) as __main__ in its own process -- own pid, cwd,
# stdout/stderr files, exit code, signals, file locks -- and ends the way the interpreter ends a script:
# SystemExit's code, or the traceback of an uncaught exception and exit code 1.
ZYGOTE = r"""
import json, os, resource, runpy, signal, sys, traceback
sys.path.insert(0, sys.argv[1])
import numpy, torch, tqdm, model, optim, stream  # noqa: the imports train.py would pay for on every run
from megatrain_min import data, engine, hf, plan  # noqa
from megatrain_min.checkpoints import checkpoint  # noqa
from megatrain_min.engine import reference  # noqa
import torch._dynamo, torch._subclasses.fake_tensor  # noqa: the planner's FakeTensorMode imports them (~1.7 s)
import jinja2, safetensors, tokenizers  # noqa: fine-tuning data and exports
from megatrain_min.plan import cost
WARM = [(model.PRESETS["toy"], torch.float32), (model.PRESETS["toy"], torch.bfloat16),
        (model.PRESETS["7b"], torch.bfloat16)]
probe = os.fork()                                 # a child traces first: torch 2.11's autograd starts its device
if probe == 0:                                    # threads for the trace's backward (2.13's none), and a process
    signal.alarm(120)                             # with those must not fork (its children's autograd refuses);
    n = len(os.listdir("/proc/self/task"))        # (the imports' OpenBLAS threads handle a fork themselves, and
    for cfg, dtype in WARM:                       # a forked child starts with one thread)
        cost.elementwise_bytes(cfg, dtype)
    os._exit(len(os.listdir("/proc/self/task")) != n)
warm = os.waitstatus_to_exitcode(os.waitpid(probe, 0)[1]) == 0
for cfg, dtype in WARM if warm else []:
    cost.elementwise_bytes(cfg, dtype)
threads = set(os.listdir("/proc/self/task"))
for line in sys.stdin:
    req = json.loads(line)
    if "trace" in req:        # a config the next runs plan (TrainCLI.trace): the probe's code, so no thread
        if warm:              # starts either; should one, stop here
            cost.elementwise_bytes(model.GPTConfig(**req["trace"]), getattr(torch, req["dtype"]))
            assert set(os.listdir("/proc/self/task")) <= threads, "a trace started a thread: forking is unsafe"
        print(json.dumps({"warm": warm}), flush=True)
        continue
    if "wait" in req:
        print(json.dumps({"rc": os.waitstatus_to_exitcode(os.waitpid(req["wait"], 0)[1])}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            for fd, path in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC), fd)
            if req["closed_stdout"]:                      # `| head -c 0`: a pipe whose reader has left
                read, write = os.pipe()
                os.close(read)
                os.dup2(write, 1)
            if req["fsize"] is not None:                  # `ulimit -f`: a write past it fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
            if req["memory"] is not None:                 # `ulimit -v`: this many bytes more than it maps now
                status = open("/proc/self/status").read().splitlines()
                vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
                resource.setrlimit(resource.RLIMIT_AS, (vm + req["memory"], vm + req["memory"]))
            if req["modes"]:                              # root ignores file modes: drop CAP_DAC_OVERRIDE and
                import ctypes                             # CAP_DAC_READ_SEARCH (capability bits 1, 2) so they apply
                libc = ctypes.CDLL(None, use_errno=True)
                hdr, caps = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # v3 header, 2 x (eff, prm, inh)
                libc.capget(hdr, caps)
                caps[0] &= ~0b110
                if libc.capset(hdr, caps):
                    raise OSError(ctypes.get_errno(), "capset")
            signal.alarm(req["timeout"])                  # a hung run is killed
            os.environ.update(req["env"])
            if "PYTHONIOENCODING" in req["env"]:          # as the interpreter sets its streams up at start
                enc, _, errors = req["env"]["PYTHONIOENCODING"].partition(":")
                for s in (sys.stdout, sys.stderr):
                    s.reconfigure(encoding=enc or None, errors=errors or None)
            if req["module"]:                             # python -m module argv...
                sys.argv = [req["module"], *req["argv"]]
                sys.modules.pop(req["module"], None)      # run afresh as __main__, as python -m does
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [os.path.join(sys.argv[1], req["script"]), *req["argv"]]
                sys.path[0] = os.path.dirname(sys.argv[0])   # as `python script.py` puts the script's folder first
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1]
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
"""


class TrainCLI:
    """cli(*args, cwd=...) -> subprocess.CompletedProcess of `python train.py *args`; cli.start(...) -> a Run
    with .pid, whose result cli.wait(run) gives (runs may overlap: the lock and signal tests).
    script: another script of the repository (a lesson, a bench), or module: `python -m module *args`;
    env: variables set in the child; fsize: RLIMIT_FSIZE in bytes; memory: RLIMIT_AS, in bytes beyond what the
    child maps at its start (a command that would allocate more fails there, not on the machine); modes: file
    modes apply even to root (the tests run as root in containers)."""

    def __init__(self, tmp):
        self.tmp, self.n = tmp, 0
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(ROOT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, *args, cwd=ROOT, fsize=None, modes=False, timeout=300, script="train.py", module=None, env=None,
              memory=None, closed_stdout=False):
        self.n += 1
        out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
        argv = [str(a) for a in args]
        pid = self._ask(dict(argv=argv, cwd=str(cwd), stdout=str(out), stderr=str(err), fsize=fsize, modes=modes,
                             timeout=timeout, script=str(script), module=module, env=env or {},
                             memory=memory, closed_stdout=closed_stdout))["pid"]
        return SimpleNamespace(pid=pid, argv=[module or str(script), *argv], out=out, err=err)

    def trace(self, cfg, dtype="float32"):
        """The planner's trace of cfg (compute dtype: torch's name, "float32" or "bfloat16"), made once in the
        helper for the runs to come: where a run's config is made by its test (a tokenizer's vocabulary), not a
        preset the helper knows. Nothing is made where the helper's torch cannot trace without a thread."""
        assert dtype in ("float32", "bfloat16"), dtype
        assert "warm" in self._ask(dict(trace=cfg.to_dict(), dtype=dtype))

    def wait(self, run):
        rc = self._ask({"wait": run.pid})["rc"]
        return subprocess.CompletedProcess(run.argv, rc, run.out.read_text(), run.err.read_text())

    def __call__(self, *args, **kw):
        return self.wait(self.start(*args, **kw))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


_RUNNER = []


def runner():
    """This test process's TrainCLI, started on first use and closed (its files removed) when the process exits."""
    if not _RUNNER:
        tmp = Path(tempfile.mkdtemp(prefix="traincli-"))
        _RUNNER.append(TrainCLI(tmp))
        atexit.register(lambda: (_RUNNER[0].close(), shutil.rmtree(tmp, ignore_errors=True)))
    return _RUNNER[0]


def train_py(*args, **kw):
    """`python train.py *args` (or script= / module=, see TrainCLI.start) in a fresh process: CompletedProcess."""
    return runner()(*args, **kw)


@pytest.fixture(scope="session")
def cli():
    return runner()


@pytest.fixture(scope="session")
def multi_gpu_smoke(tmp_path_factory):
    """bench/multi_gpu.py --smoke, run once: its directory. Its exact case's runs -- python train.py and torchrun
    with 2 gloo ranks, the same flags, checkpoints every 4 steps -- are read by tests/test_bench.py (the harness)
    and tests/engine/test_sharded.py (train.py under torchrun); nothing writes into them."""
    out = tmp_path_factory.mktemp("multi_gpu")
    r = train_py("--smoke", "--out", out, script="bench/multi_gpu.py")
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def wait_for_training(out, timeout=120):
    """Block until the run writing to `out` has logged its first step."""
    deadline = time.time() + timeout
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
        assert time.time() < deadline, f"no step logged in {out} after {timeout} s"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- "nothing lost"
def files_under(*roots):
    """{path: bytes} of every file under the given directories (or files): what 'nothing lost' compares."""
    found = {}
    for root in map(Path, roots):
        for p in [root] if root.is_file() else sorted(root.rglob("*")) if root.is_dir() else []:
            if p.is_file():
                found[p] = p.read_bytes()
    return found


def lost(before):
    """The files of `before` (files_under's result) that are gone or changed now; [] = nothing lost."""
    return [str(p) for p, b in before.items() if not p.is_file() or p.read_bytes() != b]


def assert_refused(r, before, code=2, words=()):
    """train.py refused or stopped as documented: exit `code`, one line on stderr holding `words`, no
    traceback, and every file that existed before the run is still there byte for byte."""
    err = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, f"exit {r.returncode}, expected {code}\n{r.stderr}"
    assert len(err) == 1 and all(w in err[0] for w in words), r.stderr
    assert not lost(before), lost(before)


def pytest_collection_finish(session):
    """Every test module is imported: what the imports made (torch, transformers: ~300,000 objects that live as
    long as the process) is moved out of the garbage collector's sight (gc.freeze). Its full collections, which
    the recorder's many long-lived ops trigger often, then scan only what the tests made (tests/sim: 9.3 s of
    them -> 5.5 s)."""
    gc.freeze()
